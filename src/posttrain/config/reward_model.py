"""``reward_config``: the reward model that scores responses in the on-policy loop.

A run has a reward model when its config has a ``reward_config`` section (the seed's Megatron role
section, merged with ``megatron_training`` as every role is). The reward model

* is named by ``reward_config.load``, else ``reward_config.tokenizer_name_or_path``, written in
  ``reward_config`` itself (a path merged in from ``megatron_training`` is the actor's): an HF
  sequence-classification model, a posttrain checkpoint (``iter_*``, or a PPO checkpoint's
  ``critic/``) or a Megatron ``--orm`` checkpoint (:func:`posttrain.checkpoint.resolve_checkpoint`);
* scores ``micro_batch_size`` sequences per forward (``reward_config``'s, else the actor's), in
  bf16 where the actor would train in bf16 (``bf16``, :func:`posttrain.device.precision`);
* runs on the actor's devices: ``rl_config.reward_resource`` may only repeat ``actor_resource``'s
  count (the key's rule in :mod:`posttrain.config.sections`).

A response's score is ``rule score (if rl_config.rule_reward) + rl_config.reward_model_weight x
reward-model score`` (+ ``rl_config.judge_weight`` x the judge's score, :mod:`posttrain.config.judge`).
:func:`check_reward_model` refuses the combinations in which nothing would
score, or in which a part of the reward would be dropped without a word (a stage that scores no
responses, and the megatron backend, are rows of :mod:`posttrain.config.compat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from posttrain.config.fields import Status, field_rule, fmt_value
from posttrain.config.loader import normalise_keys
from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import RunConfig
from posttrain.device import precision
from posttrain.errors import ConfigError
from posttrain.models.arch import arch_from_hf_config

# the reward_config keys the reward model reads (``model`` applies a model yaml: its architecture)
READS = ("load", "tokenizer_name_or_path", "micro_batch_size", "bf16", "model")
SOURCE_KEYS = ("load", "tokenizer_name_or_path")
KINDS = "an HF sequence-classification model directory, a posttrain checkpoint or a Megatron --orm checkpoint"


@dataclass(frozen=True)
class RewardModelOptions:
    """What the run needs to build the reward model (``Plan.reward_model``)."""

    path: str  # reward_config.load (or tokenizer_name_or_path)
    dtype: str  # float32 or bfloat16
    micro_batch_size: int  # sequences per forward
    weight: float  # rl_config.reward_model_weight


def own_keys(cfg: RunConfig) -> dict:
    """The keys ``reward_config`` itself writes (not those merged in from ``megatron_training``)."""
    section = cfg.raw.get("reward_config")
    return normalise_keys(section) if isinstance(section, dict) else {}


def reward_model_source(cfg: RunConfig) -> tuple[str, str] | None:
    """(path, the key that names it) of the reward model, or None when ``reward_config`` names none."""
    own = own_keys(cfg)
    for key in SOURCE_KEYS:
        if own.get(key):
            return str(own[key]), key
    return None


def check_reward_model(cfg: RunConfig, *, on_policy: bool, dynamic_sampling: bool) -> None:
    """Raise :class:`ConfigError` for a reward setting that cannot run as written (module doc)."""
    rl, has_model = cfg.rl, cfg.reward is not None
    if not on_policy:  # a reward_config there: the compatibility table's reward-model-offline row
        return
    if not has_model:
        _check_without_model(cfg)
        if not rl.rule_reward:  # the judge alone scores (posttrain.config.judge)
            _check_without_rules(cfg, dynamic_sampling)
        return
    if reward_model_source(cfg) is None:
        raise ConfigError(f"reward_config names no reward model: set reward_config.load to {KINDS} (a load or "
                          f"tokenizer_name_or_path merged in from megatron_training is the actor's, not a reward "
                          f"model)")
    if not rl.rule_reward:
        if rl.reward_model_weight == 0 and not rl.judge_path:
            raise ConfigError("rl_config.rule_reward=false with rl_config.reward_model_weight=0: every score would "
                              "be 0; give the reward model a weight or set rule_reward: true")
        _check_without_rules(cfg, dynamic_sampling)
    _check_own_keys(cfg)


def _check_without_rules(cfg: RunConfig, dynamic_sampling: bool) -> None:
    """rule_reward: false: the settings that read the rule reward have nothing to read."""
    rl = cfg.rl
    if rl.overlong_buffer_enable:
        raise ConfigError("rl_config.overlong_buffer_enable=true with rl_config.rule_reward=false: the DAPO "
                          "overlong penalty is added to the rule reward, which does not run; set rule_reward: "
                          "true or overlong_buffer_enable: false")
    if dynamic_sampling:
        raise ConfigError(f"rl_config.filter_groups_enable=true with rl_config.rule_reward=false: dynamic "
                          f"sampling keeps the groups whose verifier scores vary (filter_groups_metric="
                          f"{rl.filter_groups_metric}), and no verifier runs; set rule_reward: true or "
                          f"filter_groups_enable: false")


def _check_without_model(cfg: RunConfig) -> None:
    rl = cfg.rl
    add = f"add a reward_config section whose load names a reward model ({KINDS})"
    if not rl.rule_reward and not rl.judge_path:
        raise ConfigError(f"rl_config.rule_reward=false and no reward_config: nothing would score the responses; "
                          f"set rule_reward: true (the verifiers of rl_config.verifier_function), set "
                          f"rl_config.judge_path (an LLM judge) or {add}")
    if rl.reward_resource is not None:
        raise ConfigError(f"rl_config.reward_resource={fmt_value(rl.reward_resource)}: there is no reward model to "
                          f"place (no reward_config); remove the key or {add}")
    if cfg.explicitly_set("rl_config", "reward_model_weight"):
        raise ConfigError(f"rl_config.reward_model_weight={fmt_value(rl.reward_model_weight)}: there is no reward "
                          f"model to weigh (no reward_config); remove the key or {add}")


def _check_own_keys(cfg: RunConfig) -> None:
    """The frozen reward model reads :data:`READS`; another honoured key that ``reward_config`` writes
    must not differ from the actor's (refused and warned keys are reported by their own rules)."""
    for name in own_keys(cfg):
        rule = field_rule(MegatronConfig, name) if name in MegatronConfig.model_fields else None
        if name in READS or rule is None or rule.status is not Status.HONOURED:
            continue
        mine, actor = getattr(cfg.reward, name), getattr(cfg.actor, name)
        if mine != actor:
            raise ConfigError(f"reward_config.{name}={fmt_value(mine)}: the reward model is frozen and reads only "
                              f"reward_config.load (or tokenizer_name_or_path), micro_batch_size and bf16 (its "
                              f"architecture comes from its own config.json); remove the key or give it the "
                              f"actor's value ({fmt_value(actor)})")


def reward_model_options(cfg: RunConfig, device: str, *, on_policy: bool) -> RewardModelOptions | None:
    """The reward model of a checked config (None when it has none, or the stage scores nothing)."""
    source = reward_model_source(cfg)
    if cfg.reward is None or not on_policy or source is None:
        return None
    dtype, _ = precision(device, bf16=bool(cfg.reward.bf16), rollout_dtype="float32")
    batch = cfg.reward.micro_batch_size or cfg.actor.micro_batch_size or 1
    return RewardModelOptions(path=source[0], dtype=dtype, micro_batch_size=int(batch),
                              weight=float(cfg.rl.reward_model_weight))


def reward_model_arch(cfg: RunConfig):
    """The reward model's :class:`~posttrain.models.arch.ModelArch` from its ``config.json`` (a PPO
    checkpoint's ``critic/`` first), read without loading it; None where there is none to read (a
    save directory, a Megatron checkpoint) or it describes no model."""
    source = reward_model_source(cfg)
    if source is None:
        return None
    for directory in (Path(source[0]) / "critic", Path(source[0])):
        if (directory / "config.json").is_file():
            try:
                return arch_from_hf_config(directory)
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                return None
    return None
