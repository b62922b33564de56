"""Algorithm bundles: what makes GRPO, DAPO and PPO differ inside the one on-policy loop.

A bundle says which roles the loop needs (reference, critic), which keyword arguments the actor
loss gets, and which config combinations it rejects. The loop itself is the same for all of them
(:mod:`posttrain.trainers.onpolicy`); PPO adds the critic phases of
:mod:`posttrain.trainers.ppo` and DAPO the dynamic sampling of
:mod:`posttrain.trainers.dynamic_sampling`.

=======  ==========  ===========  ===================  ============================================
bundle   reference   critic       KL                   actor loss
=======  ==========  ===========  ===================  ============================================
grpo     if kl > 0   no           in the loss          PPO clip, token-mean
dapo     never       no           none                 clip-higher, token_level_loss, dyn. sampling
ppo      if KL in    yes (GAE)    in the reward        PPO clip, token-mean; critic: clipped value
         reward                   (use_kl_in_reward)   loss
=======  ==========  ===========  ===================  ============================================

Beyond the seed, every bundle takes ``rl_config.policy_loss`` (``ppo``, ``gspo``), the dual clip
``rl_config.clip_ratio_c``, and ``rl_config.loss_agg_mode`` (``token-mean``,
``seq-mean-token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``); GRPO and DAPO take
any critic-free ``rl_config.adv_estimator`` (``group_norm``, ``grpo_no_std``/``dr_grpo``,
``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from posttrain.config.sections import RLConfig
from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.config.run import RunConfig

CRITIC_ESTIMATORS = ("gae",)


@dataclass(frozen=True)
class Bundle:
    name: str
    metric_prefix: str  # grpo/score/*, dapo/score/*, critic/score/*
    uses_reference: Callable[[RLConfig], bool]
    uses_critic: bool
    kl_in_loss: bool  # GRPO: kl_coef * KL(actor || ref) is a loss term
    actor_loss_kwargs: Callable[..., dict]
    default_loss_agg_mode: Callable[[RLConfig], str] = lambda rl: "token-mean"
    check: Callable[["RunConfig"], None] = lambda cfg: None


def _clip(rl: RLConfig) -> dict:
    """clip-higher (DAPO, Yu et al. 2025) when enabled, else the symmetric ``clip_ratio``."""
    low, high = (rl.clip_ratio_low, rl.clip_ratio_high) if rl.clip_higher_enable else (rl.clip_ratio, rl.clip_ratio)
    return {"clip_ratio": rl.clip_ratio, "clip_ratio_low": low, "clip_ratio_high": high}


def _loss_kwargs(bundle_default: Callable[[RLConfig], str], *, with_kl: bool):
    def kwargs(rl: RLConfig, max_tokens: int | None = None) -> dict:
        out = {"policy_loss": rl.policy_loss, **_clip(rl), "clip_ratio_c": rl.clip_ratio_c,
               "entropy_coeff": rl.entropy_coeff, "loss_agg_mode": rl.loss_agg_mode or bundle_default(rl)}
        if out["loss_agg_mode"] == "seq-mean-token-sum-norm" and max_tokens:
            out["norm_length"] = float(max_tokens)  # Dr. GRPO's constant: the generation budget
        if with_kl:
            out["kl_penalty"] = rl.kl_penalty
        return out

    return kwargs


def _dapo_agg(rl: RLConfig) -> str:
    return "token-mean" if rl.token_level_loss else "seq-mean-token-mean"


# ---- config checks ---------------------------------------------------------------------------
def _check_common(cfg: "RunConfig") -> None:
    """Names that only fail deep inside the first iteration otherwise."""
    from posttrain.algo.advantages import get_advantage_estimator
    from posttrain.algo.aggregation import aggregation_modes
    from posttrain.algo.policy_loss import get_policy_loss

    rl = cfg.rl
    get_advantage_estimator(rl.adv_estimator)
    get_policy_loss(rl.policy_loss)
    if rl.loss_agg_mode is not None and rl.loss_agg_mode not in aggregation_modes():
        raise ConfigError(f"rl_config.loss_agg_mode: unknown '{rl.loss_agg_mode}'. Known: "
                          f"{', '.join(aggregation_modes())}")
    if rl.clip_ratio_c is not None and rl.clip_ratio_c <= 1.0:
        raise ConfigError(f"rl_config.clip_ratio_c must be > 1 (dual-clip PPO, e.g. 3.0); got {rl.clip_ratio_c}")
    if rl.adv_estimator == "rloo" and rl.n_samples_per_prompt < 2:
        raise ConfigError("rl_config.adv_estimator 'rloo' needs n_samples_per_prompt >= 2 "
                          f"(got {rl.n_samples_per_prompt})")


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


def _check_grpo(cfg: "RunConfig") -> None:
    _check_common(cfg)
    _check_critic_free(cfg)
    if cfg.rl.filter_groups_enable:
        raise ConfigError("rl_config.filter_groups_enable (dynamic sampling) is a DAPO option: "
                          "use stage ray_dapo or set filter_groups_enable: false")


def _check_dapo(cfg: "RunConfig") -> None:
    _check_common(cfg)
    _check_critic_free(cfg)
    rl = cfg.rl
    if cfg.raw.get("ref_config") is not None:  # the seed's message (DAPO has no reference model)
        raise ConfigError("ref_config should not be set when use_integrated_worker mode is on.")
    if rl.filter_groups_enable:
        fgtbs = rl.filter_groups_train_batch_size
        if fgtbs < 1:
            raise ConfigError(f"rl_config.filter_groups_train_batch_size must be >= 1 (prompts); got {fgtbs}")
        if fgtbs % rl.mini_batch_size != 0:
            raise ConfigError(f"rl_config.mini_batch_size {rl.mini_batch_size} must divide "
                              f"filter_groups_train_batch_size {fgtbs} (both count prompts): DAPO with dynamic "
                              f"sampling updates on filter_groups_train_batch_size prompts")
        if rl.filter_groups_metric not in rl.verifier_function:
            raise ConfigError(f"filter_groups_metric {rl.filter_groups_metric} must in verifier_function "
                              f"{rl.verifier_function}")


def _check_ppo(cfg: "RunConfig") -> None:
    _check_common(cfg)
    rl = cfg.rl
    if rl.adv_estimator not in CRITIC_ESTIMATORS:
        raise ConfigError(f"stage ray_ppo trains a critic and needs rl_config.adv_estimator: gae (got "
                          f"'{rl.adv_estimator}'); for critic-free estimators use stage ray_grpo")
    if rl.cliprange_value <= 0:
        raise ConfigError(f"rl_config.cliprange_value must be > 0 (the seed's default is 0.5); got {rl.cliprange_value}")
    if not 0.0 <= rl.lam <= 1.0 or not 0.0 <= rl.gamma <= 1.0:
        raise ConfigError(f"rl_config.gamma and lam must be in [0, 1]; got gamma={rl.gamma}, lam={rl.lam}")
    if rl.filter_groups_enable:
        raise ConfigError("rl_config.filter_groups_enable (dynamic sampling) is a DAPO option: "
                          "use stage ray_dapo or set filter_groups_enable: false")
    if rl.use_kl_in_reward and rl.init_kl_coef <= 0:
        raise ConfigError("rl_config.use_kl_in_reward needs init_kl_coef > 0 (the KL coefficient beta)")


BUNDLES: dict[str, Bundle] = {
    "grpo": Bundle("grpo", "grpo", uses_reference=lambda rl: rl.init_kl_coef > 0, uses_critic=False,
                   kl_in_loss=True, actor_loss_kwargs=_loss_kwargs(lambda rl: "token-mean", with_kl=True),
                   check=_check_grpo),
    "dapo": Bundle("dapo", "dapo", uses_reference=lambda rl: False, uses_critic=False, kl_in_loss=False,
                   actor_loss_kwargs=_loss_kwargs(_dapo_agg, with_kl=False), default_loss_agg_mode=_dapo_agg,
                   check=_check_dapo),
    "ppo": Bundle("ppo", "critic", uses_reference=lambda rl: rl.use_kl_in_reward, uses_critic=True,
                  kl_in_loss=False, actor_loss_kwargs=_loss_kwargs(lambda rl: "token-mean", with_kl=False),
                  check=_check_ppo),
}


def get_bundle(stage: str) -> Bundle:
    if stage not in BUNDLES:
        raise ConfigError(f"no on-policy algorithm '{stage}'; known: {', '.join(BUNDLES)}")
    return BUNDLES[stage]


def check_algorithm_config(cfg: "RunConfig") -> None:
    """The algorithm-specific rules for ``cfg.stage`` (on-policy bundles and DPO); ConfigError on the first."""
    if cfg.stage in BUNDLES:
        BUNDLES[cfg.stage].check(cfg)
    elif cfg.stage == "dpo":
        from posttrain.trainers.dpo import check_dpo_config

        check_dpo_config(cfg)
