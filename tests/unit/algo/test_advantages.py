"""Advantage estimators: seed values and hand-computed examples."""

import math

import pytest
import torch

from posttrain.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, scores_to_token_level_rewards
from posttrain.errors import ConfigError


def _outcome(scores, length=2, total=3):
    """Scores at the last of ``length`` valid tokens in rows of ``total`` columns."""
    mask = torch.zeros(len(scores), total)
    mask[:, :length] = 1
    return scores_to_token_level_rewards(torch.tensor(scores), mask), mask


def test_scores_placed_at_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    rewards = scores_to_token_level_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert rewards.tolist() == [[0, 2, 0], [0, 0, 3], [0, 0, 0]]


def test_group_norm_seed_value():
    rewards, mask = _outcome([1.0, 2.0], length=1, total=1)
    adv, ret = ADVANTAGE_ESTIMATORS.get("group_norm")(rewards, mask, group_size=2)
    assert torch.allclose(adv.squeeze(-1), torch.tensor([-0.7071, 0.7071]), atol=1e-4)
    assert torch.equal(adv, ret)


def test_group_norm_broadcasts_and_masks():
    rewards, mask = _outcome([0.0, 0.0, 1.0, 1.0, 5.0, 5.0])
    adv, _ = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, mask, group_size=2)
    # groups are contiguous rows: [0,0], [1,1], [5,5] -> no spread -> 0
    assert torch.all(adv == 0)
    rewards, mask = _outcome([0.0, 0.0, 1.0, 1.0])
    adv, _ = ADVANTAGE_ESTIMATORS.get("group_norm")(rewards, mask, group_size=4)
    expected = 0.5 / math.sqrt(1 / 3)  # unbiased std of [0,0,1,1]
    assert torch.allclose(adv[:, 0], torch.tensor([-expected, -expected, expected, expected]), atol=1e-5)
    assert torch.all(adv[:, 2] == 0)  # padding


def test_dr_grpo_and_rloo():
    rewards, mask = _outcome([0.0, 0.0, 1.0, 1.0])
    adv, _ = ADVANTAGE_ESTIMATORS.get("grpo_no_std")(rewards, mask, group_size=4)
    assert torch.allclose(adv[:, 1], torch.tensor([-0.5, -0.5, 0.5, 0.5]))
    adv, _ = ADVANTAGE_ESTIMATORS.get("rloo")(rewards, mask, group_size=4)
    assert torch.allclose(adv[:, 1], torch.tensor([-2 / 3, -2 / 3, 2 / 3, 2 / 3]))
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        ADVANTAGE_ESTIMATORS.get("rloo")(rewards, mask, group_size=1)


def test_reinforce_plus_plus_whitens_returns_over_batch():
    rewards, mask = _outcome([1.0, 0.0])
    adv, ret = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(rewards, mask, gamma=1.0)
    assert ret.tolist() == [[1, 1, 0], [0, 0, 0]]
    k = 0.5 / math.sqrt(1 / 3)  # values 1,1,0,0: mean .5, unbiased var 1/3
    assert torch.allclose(adv, torch.tensor([[k, k, 0], [-k, -k, 0]]), atol=1e-5)
    _, ret = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    assert ret.tolist() == [[0.5, 1, 0], [0, 0, 0]]


def test_reinforce_plus_plus_baseline_subtracts_group_mean():
    rewards, mask = _outcome([3.0, 1.0, 10.0, 8.0])
    adv, ret = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus_baseline")(rewards, mask, group_size=2)
    assert torch.allclose(ret[:, 0], torch.tensor([1.0, -1.0, 1.0, -1.0]))
    k = 1 / math.sqrt(8 / 7)  # eight values of +-1: unbiased var 8/7
    assert torch.allclose(adv[:, 0], torch.tensor([k, -k, k, -k]), atol=1e-5)


def test_gae_seed_example():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    mask = torch.ones(1, 3)
    adv, ret = ADVANTAGE_ESTIMATORS.get("gae")(rewards, mask, values=values, gamma=0.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[-1.0, 0.0, 1.0]]), atol=1e-5)
    assert torch.allclose(ret, torch.tensor([[1.0, 2.0, 3.0]]))


def test_gae_ignores_values_past_the_response():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 99.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv, ret = ADVANTAGE_ESTIMATORS.get("gae")(rewards, mask, values=values, whiten=False)
    # gamma = lam = 1: returns = the outcome reward everywhere, gae = 1 - V
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.5]]))


def test_unknown_estimator_lists_known_names():
    with pytest.raises(ConfigError) as err:
        ADVANTAGE_ESTIMATORS.get("remax")
    for name in ("group_norm", "gae", "rloo", "reinforce_plus_plus"):
        assert name in str(err.value)
    assert set(ADVANTAGE_ESTIMATORS.names()) >= {"grpo_no_std", "dr_grpo", "reinforce_plus_plus_baseline"}


def test_group_size_must_divide_batch():
    rewards, mask = _outcome([1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match="groups"):
        ADVANTAGE_ESTIMATORS.get("group_norm")(rewards, mask, group_size=2)


def test_estimators_reject_keywords_they_do_not_use():
    rewards, mask = _outcome([1.0, 2.0])
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS.get("group_norm")(rewards, mask, group_size=2, gamma=1.0)
    with pytest.raises(TypeError):
        ADVANTAGE_ESTIMATORS.get("gae")(rewards, mask, values=torch.zeros_like(mask), group_sise=2)


@pytest.mark.parametrize("name", ["group_norm", "grpo_no_std", "rloo", "reinforce_plus_plus",
                                  "reinforce_plus_plus_baseline", "gae"])
def test_compute_advantages_passes_each_estimator_its_keywords(name):
    rewards, mask = _outcome([3.0, 1.0, 10.0, 8.0])
    values = torch.full_like(mask, 0.5)
    got = compute_advantages(name, rewards, mask, group_size=2, gamma=0.9, lam=0.8, values=values, whiten=True)
    offered = {"group_size": 2, "gamma": 0.9, "lam": 0.8, "values": values, "whiten": True}
    direct = {
        "group_norm": ("group_size",), "grpo_no_std": ("group_size",), "rloo": ("group_size",),
        "reinforce_plus_plus": ("gamma",), "reinforce_plus_plus_baseline": ("group_size", "gamma"),
        "gae": ("values", "gamma", "lam", "whiten"),
    }[name]
    want = ADVANTAGE_ESTIMATORS.get(name)(rewards, mask, **{k: offered[k] for k in direct})
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_compute_advantages_errors():
    rewards, mask = _outcome([1.0, 2.0])
    with pytest.raises(ConfigError, match="critic values"):
        compute_advantages("gae", rewards, mask, group_size=2, gamma=1.0, lam=1.0)
    with pytest.raises(ConfigError, match="rl_config.adv_estimator"):
        compute_advantages("remax", rewards, mask, group_size=2, gamma=1.0, lam=1.0)
