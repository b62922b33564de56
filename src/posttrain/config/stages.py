"""The one table of training stages: what each algorithm needs and which rules its config obeys.

``megatron_training.stage`` names a stage by one of its aliases (the seed's ``ray_grpo``, ...).
A :class:`Stage` says which loop trains it (a ``"module:Class"`` path, imported only when a run
starts, so this module stays in the config layer), which roles that loop builds, how the actor
loss is configured, and the stage's own config rules (run by :func:`posttrain.config.check.check_run_config`
after the seed's).

=======  ==========  ===========  ===================  ============================================
stage    reference   critic       KL                   actor loss
=======  ==========  ===========  ===================  ============================================
grpo     if kl > 0   no           in the loss          PPO clip, token-mean
dapo     never       no           none                 clip-higher, token_level_loss, dyn. sampling
ppo      if KL in    yes (GAE)    in the reward        PPO clip, token-mean; critic: clipped value
         reward                   (use_kl_in_reward)   loss
dpo      always      no           (the DPO loss)       DPO (dpo_loss_type); KTO on unpaired rows
sft      never       no           none                 cross-entropy on response tokens
=======  ==========  ===========  ===================  ============================================

Beyond the seed, the on-policy stages take ``rl_config.policy_loss`` (``ppo``, ``gspo``), the dual
clip ``rl_config.clip_ratio_c`` and ``rl_config.loss_agg_mode``; GRPO and DAPO take any critic-free
``rl_config.adv_estimator``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.config.run import RunConfig

ONPOLICY = "posttrain.loops.onpolicy:OnPolicyTrainer"
CRITIC_ESTIMATORS = ("gae",)


@dataclass(frozen=True)
class Stage:
    name: str
    aliases: tuple[str, ...]
    loop: str  # "module:Class" of the loop that trains this stage
    check: Callable[["RunConfig"], None]
    metric_prefix: str  # grpo/score/*, dapo/score/*, critic/score/*, sft/*, dpo/*
    uses_reference: Callable[["RunConfig"], bool] = lambda cfg: False
    uses_critic: bool = False
    kl_in_loss: bool = False  # GRPO: kl_coef * KL(actor || ref) is a loss term
    default_loss_agg_mode: Callable[["RunConfig"], str] = lambda cfg: "token-mean"
    dynamic_sampling: Callable[["RunConfig"], bool] = lambda cfg: False  # DAPO's filter_groups_enable

    @property
    def on_policy(self) -> bool:
        return self.loop == ONPOLICY


# ---- the stages' own rules ---------------------------------------------------------------------
def _check_common(cfg: "RunConfig") -> None:
    """Names that only fail deep inside the first iteration otherwise."""
    from posttrain.algo.advantages import ADVANTAGE_ESTIMATORS  # lazy: algo/ imports torch; keeps config/ light
    from posttrain.algo.aggregation import AGGREGATIONS
    from posttrain.algo.kl import KL_PENALTIES
    from posttrain.algo.policy_loss import POLICY_LOSSES

    rl = cfg.rl
    ADVANTAGE_ESTIMATORS.get(rl.adv_estimator)
    POLICY_LOSSES.get(rl.policy_loss)
    KL_PENALTIES.get(rl.kl_penalty)
    if rl.loss_agg_mode is not None:
        AGGREGATIONS.get(rl.loss_agg_mode)
    for key in ("sapo_tau_pos", "sapo_tau_neg"):
        if getattr(rl, key) is not None and rl.policy_loss != "sapo":
            raise ConfigError(f"rl_config.{key} is the temperature of SAPO's gate, and rl_config.policy_loss is "
                              f"{rl.policy_loss!r}; set policy_loss: sapo or remove the key")
    if rl.rollout_correction_floor is not None and rl.rollout_correction not in ("mis", "icepop"):
        raise ConfigError(f"rl_config.rollout_correction_floor is the lower edge of the band of mis and icepop, and "
                          f"rl_config.rollout_correction is {rl.rollout_correction!r}; set it to mis or icepop or "
                          "remove the key")
    if rl.kl_ctrl_type == "adaptive" and rl.kl_horizon <= 0:  # the seed's check (its KL controller's)
        raise ConfigError(f"rl_config.kl_horizon must be larger than 0. Got {rl.kl_horizon}.")
    if rl.adv_estimator == "rloo" and rl.n_samples_per_prompt < 2:
        raise ConfigError("rl_config.adv_estimator 'rloo' needs n_samples_per_prompt >= 2 "
                          f"(got {rl.n_samples_per_prompt})")


def _dpo_reads_a_reference(cfg: "RunConfig") -> bool:
    from posttrain.algo.dpo_loss import REFERENCE_FREE  # lazy: algo/ imports torch

    return cfg.actor.dpo_loss_type not in REFERENCE_FREE


def _no_dynamic_sampling(cfg: "RunConfig") -> None:
    if cfg.rl.filter_groups_enable:
        raise ConfigError("rl_config.filter_groups_enable (dynamic sampling) is a DAPO option: "
                          "use stage ray_dapo or set filter_groups_enable: false")


def _check_critic_free(cfg: "RunConfig") -> None:
    rl, stage = cfg.rl, cfg.actor.stage or cfg.stage
    if rl.adv_estimator in CRITIC_ESTIMATORS:
        raise ConfigError(f"rl_config.adv_estimator '{rl.adv_estimator}' needs a critic; it is only valid with "
                          f"stage ray_ppo (this config has stage {stage}). Use group_norm, grpo_no_std, rloo, "
                          f"reinforce_plus_plus or reinforce_plus_plus_baseline")
    if rl.use_kl_in_reward:
        raise ConfigError(f"rl_config.use_kl_in_reward is a PPO option (stage ray_ppo); stage {stage} "
                          f"{'puts the KL in the loss (init_kl_coef)' if cfg.stage == 'grpo' else 'has no KL'}. "
                          f"Set use_kl_in_reward: false")
    if cfg.critic is not None:
        raise ConfigError(f"critic_config is only used by stage ray_ppo (this config has stage {stage}); remove it")


def check_grpo(cfg: "RunConfig") -> None:
    _check_common(cfg)
    _check_critic_free(cfg)
    _no_dynamic_sampling(cfg)


def check_dapo(cfg: "RunConfig") -> None:
    _check_common(cfg)
    _check_critic_free(cfg)
    rl = cfg.rl
    if rl.filter_groups_enable:  # filter_groups_train_batch_size >= 1: declared on the field
        fgtbs = rl.filter_groups_train_batch_size
        if fgtbs % rl.mini_batch_size != 0:
            raise ConfigError(f"rl_config.mini_batch_size {rl.mini_batch_size} must divide "
                              f"filter_groups_train_batch_size {fgtbs} (both count prompts): DAPO with dynamic "
                              f"sampling updates on filter_groups_train_batch_size prompts")


def check_ppo(cfg: "RunConfig") -> None:
    _check_common(cfg)
    _no_dynamic_sampling(cfg)
    rl = cfg.rl
    if rl.adv_estimator not in CRITIC_ESTIMATORS:
        raise ConfigError(f"stage ray_ppo trains a critic and needs rl_config.adv_estimator: gae (got "
                          f"'{rl.adv_estimator}'); for critic-free estimators use stage ray_grpo")
    if rl.use_kl_in_reward and rl.init_kl_coef <= 0:
        raise ConfigError("rl_config.use_kl_in_reward needs init_kl_coef > 0 (the KL coefficient beta)")


def check_dpo(cfg: "RunConfig") -> None:
    """DPO's own rules (the loss type is checked with the seed's message by the seed's rules; the
    ranges of dpo_beta, dpo_label_smoothing and pref_ftx are declared on their fields)."""
    a = cfg.actor
    if a.dpo_loss_type == "kto":
        _check_kto(cfg)
        return
    if not a.is_pairwise_dataset:
        raise ConfigError("stage dpo trains on preference pairs: set megatron_training.is_pairwise_dataset: true "
                          "and preprocess the data with handler_name: AlpacaStylePairwiseHandler")
    for key in ("kto_desirable_weight", "kto_undesirable_weight"):
        if getattr(a, key) != 1.0:
            raise ConfigError(f"megatron_training.{key}={getattr(a, key)} weighs KTO's rows (dpo_loss_type: kto), "
                              f"not dpo_loss_type: {a.dpo_loss_type}; remove it or set dpo_loss_type: kto")


def _check_kto(cfg: "RunConfig") -> None:
    """KTO (posttrain.algo.kto_loss) trains on unpaired rows, with no label smoothing or SFT term."""
    a = cfg.actor
    if a.is_pairwise_dataset:
        raise ConfigError("dpo_loss_type: kto trains on unpaired rows (prompt, completion, label): set "
                          "megatron_training.is_pairwise_dataset: false and preprocess the data with handler_name: "
                          "UnpairedPreferenceHandler")
    for key in ("dpo_label_smoothing", "pref_ftx"):
        if getattr(a, key) != 0:
            raise ConfigError(f"megatron_training.{key}={getattr(a, key)} is for the pairwise DPO losses; "
                              "dpo_loss_type: kto has no such term: remove it")
    if (a.global_batch_size or 0) < 2:
        raise ConfigError(f"megatron_training.global_batch_size={a.global_batch_size}: dpo_loss_type: kto estimates "
                          "its KL reference point on each row's prompt with another row's completion, so a batch "
                          "needs at least 2 rows")


def check_sft(cfg: "RunConfig") -> None:
    """SFT has no rules beyond the seed's."""


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("grpo", ("ray_grpo", "grpo"), ONPOLICY, check_grpo, "grpo",
          uses_reference=lambda cfg: cfg.rl.init_kl_coef > 0, kl_in_loss=True),
    Stage("dapo", ("ray_dapo", "dapo"), ONPOLICY, check_dapo, "dapo",
          default_loss_agg_mode=lambda cfg: "token-mean" if cfg.rl.token_level_loss else "seq-mean-token-mean",
          dynamic_sampling=lambda cfg: cfg.rl.filter_groups_enable),
    Stage("ppo", ("ray_ppo", "ppo"), ONPOLICY, check_ppo, "critic",
          uses_reference=lambda cfg: cfg.rl.use_kl_in_reward, uses_critic=True),
    Stage("dpo", ("dpo", "ray_dpo"), "posttrain.loops.dpo:preference_trainer", check_dpo, "dpo",
          uses_reference=lambda cfg: _dpo_reads_a_reference(cfg)),
    Stage("sft", ("sft",), "posttrain.loops.offline:SFTTrainer", check_sft, "sft"),
)}
ALIASES = {alias: stage.name for stage in STAGES.values() for alias in stage.aliases}


def stage_named(name: str | None) -> Stage:
    """The stage ``megatron_training.stage`` names (by any alias); ConfigError listing the known ones."""
    if name is None:
        raise ConfigError("megatron_training.stage is not set: use ray_grpo, ray_dapo, ray_ppo, dpo or sft")
    if name not in ALIASES:
        raise ConfigError(f"megatron_training.stage: unknown stage '{name}'. Known: {', '.join(ALIASES)}")
    return STAGES[ALIASES[name]]
