"""Algorithm bundles: what makes GRPO, DAPO and PPO differ inside the one on-policy loop.

A bundle says which roles the loop needs (reference, critic), which advantage estimator runs, and
which keyword arguments the actor loss gets. The loop itself is the same for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from posttrain.config.sections import RLConfig
from posttrain.errors import ConfigError


@dataclass(frozen=True)
class Bundle:
    name: str
    metric_prefix: str  # grpo/score/*, dapo/score/*, critic/score/*
    uses_reference: Callable[[RLConfig], bool]
    uses_critic: bool
    kl_in_loss: bool  # GRPO: kl_coef * KL(actor || ref) is a loss term
    actor_loss_kwargs: Callable[[RLConfig], dict]


def _grpo_loss(rl: RLConfig) -> dict:
    return {"policy_loss": rl.policy_loss, "clip_ratio": rl.clip_ratio, "clip_ratio_c": rl.clip_ratio_c,
            "kl_penalty": rl.kl_penalty, "entropy_coeff": rl.entropy_coeff, "loss_agg_mode": "token-mean"}


def _dapo_loss(rl: RLConfig) -> dict:
    low, high = (rl.clip_ratio_low, rl.clip_ratio_high) if rl.clip_higher_enable else (rl.clip_ratio, rl.clip_ratio)
    return {"policy_loss": rl.policy_loss, "clip_ratio": rl.clip_ratio, "clip_ratio_low": low,
            "clip_ratio_high": high, "clip_ratio_c": rl.clip_ratio_c, "entropy_coeff": rl.entropy_coeff,
            "loss_agg_mode": "token-mean" if rl.token_level_loss else "seq-mean-token-mean"}


def _ppo_loss(rl: RLConfig) -> dict:
    return {"policy_loss": rl.policy_loss, "clip_ratio": rl.clip_ratio, "clip_ratio_c": rl.clip_ratio_c,
            "entropy_coeff": rl.entropy_coeff, "loss_agg_mode": "token-mean"}


BUNDLES: dict[str, Bundle] = {
    "grpo": Bundle("grpo", "grpo", uses_reference=lambda rl: rl.init_kl_coef > 0, uses_critic=False,
                   kl_in_loss=True, actor_loss_kwargs=_grpo_loss),
    "dapo": Bundle("dapo", "dapo", uses_reference=lambda rl: False, uses_critic=False, kl_in_loss=False,
                   actor_loss_kwargs=_dapo_loss),
    "ppo": Bundle("ppo", "critic", uses_reference=lambda rl: rl.use_kl_in_reward, uses_critic=True,
                  kl_in_loss=False, actor_loss_kwargs=_ppo_loss),
}


def get_bundle(stage: str) -> Bundle:
    if stage not in BUNDLES:
        raise ConfigError(f"no on-policy algorithm '{stage}'; known: {', '.join(BUNDLES)}")
    return BUNDLES[stage]
