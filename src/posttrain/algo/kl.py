"""Per-token KL penalties between the policy and the reference, and KL coefficient controllers.

Penalties (``d = logprobs - ref_logprobs``, per token; Schulman, "Approximating KL Divergence",
2020), by the seed's ``kl_penalty`` names:

* ``kl`` (k1): ``d``
* ``abs``: ``|d|``
* ``mse`` (k2): ``0.5 * d^2``
* ``low_var_kl`` (k3, the seed's default): ``k = clamp(-d, -20, 20)``, ``exp(k) - k - 1`` clamped
  to ``[-10, 10]``.

Seed unit test: logp=[0.5, 1.0], ref=[1.0, 0.5] -> kl [-0.5, 0.5], abs [0.5, 0.5],
mse [0.125, 0.125], low_var_kl [0.148721, 0.106531].

Controllers (Ziegler et al. 2019): ``fixed`` keeps ``init_kl_coef``; ``adaptive`` moves the
coefficient toward a target KL. Unlike the seed (quirk 5: its adaptive controller is updated on a
Ray-task copy and so never changes), the controller here is an ordinary object that keeps its
value across iterations and has ``state_dict()`` for checkpoints.
"""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError
from posttrain.registry import Registry

KL_PENALTIES = Registry("KL penalty", key="rl_config.kl_penalty")


@KL_PENALTIES.register("kl")
def _kl(logprobs, ref_logprobs):
    return logprobs - ref_logprobs


@KL_PENALTIES.register("abs")
def _abs(logprobs, ref_logprobs):
    return (logprobs - ref_logprobs).abs()


@KL_PENALTIES.register("mse")
def _mse(logprobs, ref_logprobs):
    return 0.5 * (logprobs - ref_logprobs).square()


@KL_PENALTIES.register("low_var_kl")
def _low_var_kl(logprobs, ref_logprobs):
    log_ratio = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)
    kld = torch.exp(log_ratio) - log_ratio - 1.0
    return torch.clamp(kld, min=-10.0, max=10.0)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, *, kl_penalty: str = "low_var_kl"
) -> torch.Tensor:
    """Per-token KL estimate of the named type (see module docstring); same shape as the inputs."""
    return KL_PENALTIES.get(kl_penalty)(logprobs, ref_logprobs)


class FixedKLController:
    """``value = init_kl_coef`` forever; ``update`` is a no-op."""

    def __init__(self, init_kl_coef: float):
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to do: the coefficient is fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``;
    ``value <- value * (1 + e * n_steps / horizon)``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ConfigError(f"rl_config.kl_horizon must be larger than 0. Got {horizon}.")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` toward the target; the change persists in this object."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def build_kl_controller(
    kl_ctrl_type: str = "fixed",
    *,
    init_kl_coef: float = 0.001,
    kl_target: float = 100.0,
    kl_horizon: int = 1000,
) -> FixedKLController | AdaptiveKLController:
    """``fixed`` or ``adaptive`` controller (seed defaults: target 100.0, horizon 1000)."""
    if kl_ctrl_type == "fixed":
        return FixedKLController(init_kl_coef)
    if kl_ctrl_type == "adaptive":
        return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
    raise ConfigError(f"Unknown rl_config.kl_ctrl_type={kl_ctrl_type!r}; known: adaptive, fixed.")


def apply_kl_in_reward(
    token_level_rewards: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    kl_penalty: str = "low_var_kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's KL-in-reward (seed ``apply_kl_penalty``, ``use_kl_in_reward: true``).

    ``kld = KL_penalty(old_logp, ref_logp) * M``; ``rewards = token_level_rewards - kl_coef * kld``;
    ``current_kl = mean_b(masked_mean_t(kld))`` (feed it to ``controller.update(current_kl, B)``).
    Returns the shaped rewards ``[B, R]`` and ``{"actor/reward_kl_penalty": current_kl,
    "actor/reward_kl_penalty_coeff": kl_coef}``.
    """
    mask = response_mask.to(torch.float32)
    kld = KL_PENALTIES.get(kl_penalty)(old_logprobs, ref_logprobs) * mask
    per_row = kld.sum(-1) / (mask.sum(-1) + 1e-8)
    current_kl = float(per_row.mean())
    rewards = token_level_rewards.to(torch.float32) - kl_coef * kld
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(kl_coef)}

