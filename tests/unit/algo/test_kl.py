"""KL penalties (seed values) and KL controllers."""

import pytest
import torch

from posttrain.algo.kl import AdaptiveKLController, build_kl_controller, kl_penalty
from posttrain.errors import ConfigError

LOGP = torch.tensor([0.5, 1.0])
REF = torch.tensor([1.0, 0.5])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("kl", [-0.5, 0.5]),
        ("abs", [0.5, 0.5]),
        ("mse", [0.125, 0.125]),
        ("low_var_kl", [0.148721, 0.106531]),
    ],
)
def test_seed_kl_values(name, expected):
    assert torch.allclose(kl_penalty(LOGP, REF, kl_penalty=name), torch.tensor(expected), atol=1e-6)


def test_low_var_kl_is_clamped():
    out = kl_penalty(torch.tensor([0.0]), torch.tensor([50.0]), kl_penalty="low_var_kl")
    assert out.item() == 10.0


def test_unknown_kl_type():
    with pytest.raises(ConfigError, match="low_var_kl"):
        kl_penalty(LOGP, REF, kl_penalty="full")


def test_adaptive_controller_persists_and_clips():
    ctrl = build_kl_controller("adaptive", init_kl_coef=0.1, kl_target=1.0, kl_horizon=10)
    ctrl.update(current_kl=2.0, n_steps=1)  # error clipped to +0.2 -> x1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=2.0, n_steps=1)
    assert ctrl.value == pytest.approx(0.10404)
    ctrl.update(current_kl=0.95, n_steps=10)  # error -0.05 over the full horizon -> x0.95
    assert ctrl.value == pytest.approx(0.10404 * 0.95)
    restored = AdaptiveKLController(0.5, 1.0, 10)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_fixed_controller_and_errors():
    ctrl = build_kl_controller("fixed", init_kl_coef=0.001)
    ctrl.update(current_kl=123.0, n_steps=5)
    assert ctrl.value == 0.001
    with pytest.raises(ConfigError, match="larger than 0"):
        build_kl_controller("adaptive", kl_horizon=0)
    with pytest.raises(ConfigError, match="adaptive"):
        build_kl_controller("pid")


def test_apply_kl_in_reward_values():
    from posttrain.algo.kl import apply_kl_in_reward

    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    old = torch.tensor([[0.5, 1.0, 9.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[1.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    shaped, metrics = apply_kl_in_reward(rewards, old, ref, mask, kl_coef=0.1, kl_penalty="kl")
    # row 0: kld [-0.5, 0.5, 0 (masked)], row 1: zeros
    assert torch.allclose(shaped, torch.tensor([[0.05, 0.95, 0.0], [0.0, 0.0, 2.0]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-7)
    _, metrics = apply_kl_in_reward(rewards, old, ref, mask, kl_coef=0.1, kl_penalty="abs")
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.5 + 0.0) / 2)  # mean of row means
