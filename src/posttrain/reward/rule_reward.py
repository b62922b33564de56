"""The weighted rule reward: the seed's ``verifier_function`` / ``verifier_weight``, with
``verifier_parallel`` worker processes and a real per-sample ``verifier_timeout``.

``reward_i = sum_j w_j * s_ij`` (+ the DAPO overlong penalty when enabled), where ``s_ij`` is
verifier ``j``'s score of sample ``i`` (0.0 when it timed out or raised).

Metrics: ``{name}_rewards/mean`` per verifier (raw scores), ``reward/timeouts`` and
``reward/errors`` (counts in this call), and ``reward/overlong_penalty/mean`` when enabled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from posttrain.errors import ConfigError
from posttrain.metrics.stats import verifier_reward_metrics
from posttrain.reward._worker import STATUS_ERROR, STATUS_TIMEOUT
from posttrain.reward.overlong import check_overlong, overlong_penalty
from posttrain.reward.pool import VerifierPool
from posttrain.reward.verifiers import VERIFIERS, import_verifier_modules

log = logging.getLogger(__name__)


@dataclass
class RewardBatch:
    """Everything one scoring call produced.

    ``scores[i]`` is the weighted reward of sample i; ``per_verifier[name][i]`` the raw score;
    ``status[name][i]`` is 0 ok, 1 timeout, 2 error; ``errors`` holds a few error messages.
    """

    scores: list[float]
    per_verifier: dict[str, list[float]]
    status: dict[str, list[int]]
    metrics: dict[str, float]
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RuleRewardOptions:
    """The seed's ``rl_config`` keys of the rule reward (see :class:`RuleReward`'s arguments)."""

    verifiers: tuple[str, ...]
    weights: tuple[float, ...]
    parallel: int = 1
    timeout: float = 30.0
    modules: tuple[str, ...] = ()
    overlong_buffer_enable: bool = False
    overlong_buffer: int = 0
    overlong_buffer_penalty_factor: float = 1.0
    rollout_max_tokens: int = 2048


class RuleReward:
    """Score decoded responses against labels with registered verifiers.

    Args:
        verifier_function: verifier names (``rl_config.verifier_function``).
        verifier_weight: one weight per name (``rl_config.verifier_weight``).
        verifier_parallel: worker processes (0 = inline, no timeout; for debugging).
        verifier_timeout: seconds one verifier may spend on one sample.
        verifier_modules: user modules that register verifiers (``rl_config.verifier_modules``).
        overlong_buffer_enable / overlong_buffer / overlong_buffer_penalty_factor /
        rollout_max_tokens: the DAPO overlong penalty (applied when ``response_lengths`` is given).
        memory_limit_mb: address-space limit per worker process (0 = none).
    """

    def __init__(self, verifier_function: list[str], verifier_weight: list[float],
                 verifier_parallel: int = 1, verifier_timeout: float = 30.0,
                 verifier_modules: list[str] | tuple[str, ...] = (), *,
                 overlong_buffer_enable: bool = False, overlong_buffer: int = 0,
                 overlong_buffer_penalty_factor: float = 1.0, rollout_max_tokens: int = 2048,
                 memory_limit_mb: int = 8192):
        names, weights = list(verifier_function), [float(w) for w in verifier_weight]
        if len(names) != len(weights):
            raise ConfigError(f"Verifier function and weight length mismatch: {len(names)} vs {len(weights)} "
                              f"(rl_config.verifier_function / rl_config.verifier_weight)")
        if not names:
            raise ConfigError("rl_config.verifier_function is empty; name at least one verifier")
        import_verifier_modules(list(verifier_modules))
        self.specs = [VERIFIERS.get(n) for n in names]
        self.names, self.weights = names, weights
        self.overlong = (rollout_max_tokens, overlong_buffer, overlong_buffer_penalty_factor) \
            if overlong_buffer_enable else None
        if self.overlong:
            check_overlong(rollout_max_tokens, overlong_buffer)
        self.pool = VerifierPool(self.specs, verifier_parallel, verifier_timeout,
                                 modules=verifier_modules, memory_limit_mb=memory_limit_mb)

    @classmethod
    def from_options(cls, options: RuleRewardOptions) -> "RuleReward":
        o = options
        return cls(list(o.verifiers), list(o.weights), o.parallel, o.timeout, o.modules,
                   overlong_buffer_enable=o.overlong_buffer_enable, overlong_buffer=o.overlong_buffer,
                   overlong_buffer_penalty_factor=o.overlong_buffer_penalty_factor,
                   rollout_max_tokens=o.rollout_max_tokens)

    def score(self, responses: list[str], labels: list[str], prompts: list[str] | None = None,
              **columns) -> tuple[list[float], dict[str, float]]:
        """Weighted reward per sample and the metrics dict (see module docstring)."""
        batch = self.score_detailed(responses, labels, prompts, **columns)
        return batch.scores, batch.metrics

    def score_detailed(self, responses: list[str], labels: list[str], prompts: list[str] | None = None,
                       response_lengths=None, **columns) -> RewardBatch:
        """Score a batch. Extra keyword ``columns`` (lists aligned with ``responses``, e.g.
        ``tool_call_num``) are passed per sample to verifiers that accept them."""
        n = len(responses)
        if len(labels) != n or (prompts is not None and len(prompts) != n):
            raise ValueError(f"responses ({n}), labels ({len(labels)}) and prompts must have equal lengths")
        items = []
        for i in range(n):
            kw = {k: v[i] for k, v in columns.items()}
            if prompts is not None:
                kw["prompt"] = prompts[i]
            items.extend((j, responses[i], labels[i], kw) for j in range(len(self.specs)))
        flat, status, errors = self.pool.run(items)
        V = len(self.specs)
        per = {name: flat[j::V] for j, name in enumerate(self.names)}
        stat = {name: status[j::V] for j, name in enumerate(self.names)}
        scores = [sum(w * per[name][i] for name, w in zip(self.names, self.weights)) for i in range(n)]
        metrics = verifier_reward_metrics(per)
        metrics["reward/timeouts"] = float(sum(s == STATUS_TIMEOUT for s in status))
        metrics["reward/errors"] = float(sum(s == STATUS_ERROR for s in status))
        if self.overlong and response_lengths is not None:
            pen = overlong_penalty(list(response_lengths), *self.overlong)
            scores = [s + p for s, p in zip(scores, pen)]
            metrics["reward/overlong_penalty/mean"] = sum(pen) / n if n else 0.0
        messages = sorted({e for e in errors if e})[:5]
        for msg in messages:
            log.warning("verifier problem: %s", msg)
        return RewardBatch(scores, per, stat, metrics, messages)

    def close(self) -> None:
        """Stop the worker processes."""
        self.pool.close()

    def __enter__(self) -> "RuleReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
