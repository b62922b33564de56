"""The environment's own reward: each response scored by the task its prompt came from.

``score_i = sum_j w_j * s_ij`` over the task's reward functions ``j`` (``verifiers``' weights and
scores, the trace's ``reward``). Metrics: ``{name}_rewards/mean`` per reward function (raw scores),
as the rule verifiers report theirs, and ``reward/errors`` (0: a failing reward function stops the
run with the task's error, as it would stop a ``verifiers`` evaluation's scoring).
"""

from __future__ import annotations

from posttrain.envs.config import KEY
from posttrain.errors import ConfigError
from posttrain.metrics.stats import verifier_reward_metrics
from posttrain.reward.rule_reward import RewardBatch


class EnvReward:
    """``score_detailed(responses, labels, ...)`` as :class:`~posttrain.reward.rule_reward.RuleReward`
    has it; ``labels`` are the task indexes of :class:`~posttrain.envs.dataset.EnvPromptDataset`."""

    def __init__(self, env):
        self.env = env

    def score_detailed(self, responses: list[str], labels: list[str], prompts=None, response_lengths=None,
                       **columns) -> RewardBatch:
        indexes = [self._task_index(label) for label in labels]
        rewards = self.env.score(indexes, responses)
        names = sorted({name for r in rewards for name in r})
        per = {name: [r.get(name, (0.0, 0.0))[0] for r in rewards] for name in names}
        scores = [sum(score * weight for score, weight in r.values()) for r in rewards]
        metrics = verifier_reward_metrics(per)
        metrics["reward/errors"] = 0.0
        return RewardBatch(scores, per, {name: [0] * len(scores) for name in names}, metrics)

    def score(self, responses: list[str], labels: list[str], prompts=None, **columns):
        batch = self.score_detailed(responses, labels, prompts, **columns)
        return batch.scores, batch.metrics

    def _task_index(self, label: str) -> int:
        if not label.isdigit() or int(label) >= len(self.env.tasks):
            raise ConfigError(f"{KEY}: the label {label!r} is not a task index of the environment; its prompts "
                              "come from the environment (megatron_training.data_path is not read with it)")
        return int(label)

    def close(self) -> None:
        pass
