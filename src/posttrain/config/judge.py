"""``rl_config.judge_*``: the LLM-as-judge reward of the on-policy loop (docs/rewards.md).

``rl_config.judge_path`` names the judge: a causal-LM directory (an HF model, or a posttrain save
directory or checkpoint), or ``policy`` for the self-judge (the actor rates with this step's
weights). A response's score is ``rule score (if rule_reward) + reward_model_weight x reward-model
score + judge_weight x judge score``, the judge score in [0, 1] (:mod:`posttrain.reward.judge`).
The judge runs in the training process on the hf backend; the placements it is not built for are
rows of :mod:`posttrain.config.compat` (``judge-*``).

:func:`check_judge` refuses a judge key without a judge, a template or parser that cannot work, and a
run in which nothing would score; :func:`judge_options` is the judge of a checked config
(``Plan.judge``).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.fields import fmt_value
from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError

SELF_JUDGE = "policy"
# the judge's keys besides judge_path (each meaningless without a judge)
KEYS = ("judge_template", "judge_parser", "judge_max_score", "judge_weight", "judge_max_tokens", "judge_temperature",
        "judge_timeout", "judge_failure_value")


@dataclass(frozen=True)
class JudgeOptions:
    """What the run needs to build the judge (``Plan.judge``)."""

    path: str  # rl_config.judge_path: a model directory, or "policy" (the self-judge)
    template: str  # the template text (judge_template inline, its file's text, or the default)
    parser: str  # rl_config.judge_parser: a parser name or a regex
    max_score: float
    weight: float  # rl_config.judge_weight
    max_tokens: int
    temperature: float
    timeout_s: float
    failure_value: float
    dtype: str  # the judge model's dtype (the rollout's)
    seed: int  # the run's seed (sampled judgements)

    @property
    def self_judge(self) -> bool:
        return self.path == SELF_JUDGE


def check_judge(cfg: RunConfig, *, on_policy: bool) -> None:
    """Raise :class:`ConfigError` for judge keys that cannot run as written (module doc)."""
    rl = cfg.rl
    if not rl.judge_path:
        written = [k for k in KEYS if cfg.explicitly_set("rl_config", k)]
        if written:
            raise ConfigError(f"rl_config.{written[0]}={fmt_value(getattr(rl, written[0]))}: there is no judge "
                              f"(rl_config.judge_path is not set); remove the key, or set judge_path to a causal-LM "
                              f"directory or to '{SELF_JUDGE}' (the self-judge)")
        return
    if not on_policy:  # the compatibility table's judge-offline row
        return
    from posttrain.reward.judge_parse import compile_parser  # lazy: the reward package's regex rules
    from posttrain.reward.judge_template import load_template

    load_template(rl.judge_template)
    compile_parser(rl.judge_parser)
    if not rl.rule_reward and cfg.reward is None and rl.judge_weight == 0:
        raise ConfigError("rl_config.judge_weight=0 with rule_reward=false and no reward_config: every score would "
                          "be 0; give the judge a weight or set rule_reward: true")


def judge_options(cfg: RunConfig, rollout_dtype: str, *, on_policy: bool) -> JudgeOptions | None:
    """The judge of a checked config (None without one, or where the stage scores nothing)."""
    rl = cfg.rl
    if not rl.judge_path or not on_policy:
        return None
    from posttrain.reward.judge_template import load_template

    return JudgeOptions(path=str(rl.judge_path), template=load_template(rl.judge_template), parser=rl.judge_parser,
                        max_score=float(rl.judge_max_score), weight=float(rl.judge_weight),
                        max_tokens=int(rl.judge_max_tokens), temperature=float(rl.judge_temperature),
                        timeout_s=float(rl.judge_timeout), failure_value=float(rl.judge_failure_value),
                        dtype=rollout_dtype, seed=int(cfg.actor.seed or 0))
