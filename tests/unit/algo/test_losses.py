"""Policy, value and DPO losses and loss aggregation, against hand-computed values."""

import math

import pytest
import torch

from posttrain.algo.aggregation import aggregate_loss
from posttrain.algo.dpo_loss import dpo_loss
from posttrain.algo.policy_loss import POLICY_LOSSES, actor_loss
from posttrain.algo.value_loss import value_loss
from posttrain.errors import ConfigError


def _pg(log_ratio, adv, **kw):
    logp = torch.tensor([[log_ratio]])
    return actor_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), **kw)


def test_ratio_one_gives_minus_mean_advantage():
    logp = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, 3.0]])
    loss, metrics = actor_loss(logp, logp, adv, torch.ones(2, 2))
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["actor/pg_clipfrac"].item() == 0.0
    assert metrics["actor/ppo_kl"].item() == 0.0


def test_ppo_clip_values():
    loss, m = _pg(math.log(1.5), 1.0)  # -A*r=-1.5, -A*clip=-1.2 -> max -1.2
    assert loss.item() == pytest.approx(-1.2)
    assert m["actor/pg_clipfrac"].item() == 1.0
    assert m["actor/ppo_kl"].item() == pytest.approx(-math.log(1.5))
    loss, m = _pg(math.log(1.5), -1.0)  # 1.5 vs 1.2 -> unclipped 1.5
    assert loss.item() == pytest.approx(1.5)
    assert m["actor/pg_clipfrac"].item() == 0.0


def test_clip_higher_and_dual_clip():
    loss, _ = _pg(math.log(1.25), 1.0)  # the default bounds: 0.2 on both sides
    assert loss.item() == pytest.approx(-1.2)
    loss, _ = _pg(math.log(1.25), 1.0, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.25)
    loss, m = _pg(math.log(4.0), -1.0, clip_ratio_c=3.0)  # max(4, 1.2)=4, dual-clip min(4, 3)=3
    assert loss.item() == pytest.approx(3.0)
    assert m["actor/pg_clipfrac_lower"].item() == 1.0
    loss, _ = _pg(math.log(4.0), 1.0, clip_ratio_c=3.0)  # positive advantage: no dual clip
    assert loss.item() == pytest.approx(-1.2)


def test_gspo_sequence_ratio_value_and_gradient():
    logp = torch.tensor([[math.log(1.1), math.log(1.3)]], requires_grad=True)
    loss, _ = actor_loss(
        logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
        policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
    )
    s = math.sqrt(1.1 * 1.3)  # geometric mean of the token ratios
    assert loss.item() == pytest.approx(-s, rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), -s / 2), atol=1e-6)


def test_unknown_policy_loss():
    with pytest.raises(ConfigError, match="gspo"):
        _pg(0.0, 1.0, policy_loss="reinforce")


def _grad(name, logp, old, adv, mask, **kw):
    logp = logp.clone().requires_grad_(True)
    loss, m = actor_loss(logp, old, adv, mask, policy_loss=name, **kw)
    loss.backward()
    return loss, m, logp.grad


@pytest.mark.parametrize("name", ["cispo", "sapo", "gpg"])
def test_on_policy_the_new_losses_follow_the_ppo_gradient(name):
    """At ratio 1 CISPO's weight is 1, SAPO's gate has slope 1 and GPG is PPO's first-order term: the
    gradient of each equals the clipped surrogate's (the papers' own consistency claim)."""
    torch.manual_seed(0)
    logp, adv = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    *_, ppo = _grad("ppo", logp, logp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    *_, other = _grad(name, logp, logp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert torch.allclose(other, ppo, atol=1e-6) and ppo.abs().sum() > 0


def test_cispo_keeps_the_clipped_tokens_gradient():
    old, one = torch.zeros(1, 1), torch.ones(1, 1)
    logp = torch.full((1, 1), math.log(1.5))  # r = 1.5 > 1 + 0.2
    loss, m, grad = _grad("cispo", logp, old, one, one)
    assert loss.item() == pytest.approx(-1.2 * math.log(1.5))  # -sg(clip(r)) A logp
    assert grad.item() == pytest.approx(-1.2) and m["actor/pg_clipfrac"].item() == 1.0
    *_, ppo_grad = _grad("ppo", logp, old, one, one)
    assert ppo_grad.item() == 0.0  # PPO's clip drops that token; CISPO keeps it at the clipped weight
    logp = torch.full((1, 1), math.log(1.1))  # inside the band: PPO's gradient -A r
    *_, grad = _grad("cispo", logp, old, one, one)
    assert grad.item() == pytest.approx(-1.1) and m["actor/ppo_kl"].item() == pytest.approx(-math.log(1.5))


def test_sapo_gate_values_and_temperatures():
    def sigmoid(x):
        return 1 / (1 + math.exp(-x))

    loss, _ = _pg(math.log(1.5), 1.0, policy_loss="sapo")  # A > 0: tau_pos = 1
    assert loss.item() == pytest.approx(-4 * sigmoid(0.5), rel=1e-6)
    loss, _ = _pg(math.log(1.5), -2.0, policy_loss="sapo")  # A <= 0: tau_neg = 1.05
    assert loss.item() == pytest.approx(2 * 4 / 1.05 * sigmoid(1.05 * 0.5), rel=1e-6)
    loss, _ = _pg(math.log(1.5), -2.0, policy_loss="sapo", policy_params={"tau_pos": 1.0, "tau_neg": 3.0})
    assert loss.item() == pytest.approx(2 * 4 / 3 * sigmoid(1.5), rel=1e-6)
    # the soft gate's gradient decays far from ratio 1 instead of dropping to 0 (the hard clip's)
    *_, near = _grad("sapo", torch.full((1, 1), math.log(1.3)), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    *_, far = _grad("sapo", torch.full((1, 1), math.log(6.0)), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    assert 0 < -far.item() < -near.item()


def test_gpg_is_reinforce_without_a_ratio():
    logp = torch.tensor([[-0.5, -2.0]])
    loss, m = actor_loss(logp, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), policy_loss="gpg")
    assert loss.item() == pytest.approx((1.0 - 2.0) / 2)  # mean of -A logp: (1, -2)
    assert "actor/pg_clipfrac" not in m


@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_policy_losses_are_callable_alone(name):
    torch.manual_seed(0)
    logp, old, adv = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    kw = {"loss_agg_mode": "seq-mean-token-mean", "num_tokens": 20.0, "num_seqs": 6.0}
    loss, m = POLICY_LOSSES.get(name)(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, **kw)
    # actor_loss calls the same function with its bounds: identical numbers
    ref, ref_m = actor_loss(logp, old, adv, mask, policy_loss=name, clip_low=0.2, clip_high=0.28,
                            clip_ratio_c=3.0, **kw)
    assert torch.equal(loss, ref)
    assert all(torch.equal(m[k], ref_m[k]) for k in m)
    assert set(m) == {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
    with pytest.raises(TypeError):  # the symmetric clip_ratio is resolved by the plan, never passed on
        POLICY_LOSSES.get(name)(logp, old, adv, mask, clip_ratio=0.2)


def test_actor_loss_combines_terms():
    logp = torch.zeros(1, 2)
    mask = torch.tensor([[1.0, 1.0]])
    ref = torch.tensor([[0.5, -0.5]])  # low_var_kl of 0 vs ref: exp(0.5)-1.5, exp(-0.5)-0.5
    entropy = torch.tensor([[2.0, 4.0]])
    loss, m = actor_loss(
        logp, logp, torch.ones(1, 2), mask, entropy=entropy, entropy_coeff=0.01,
        ref_logprobs=ref, kl_coef=0.1, kl_penalty="low_var_kl",
    )
    kl = ((math.exp(0.5) - 1.5) + (math.exp(-0.5) - 0.5)) / 2
    assert m["actor/pg_loss"].item() == pytest.approx(-1.0)
    assert m["actor/kl_loss"].item() == pytest.approx(kl, rel=1e-5)
    assert m["actor/entropy"].item() == pytest.approx(3.0)
    assert loss.item() == pytest.approx(-1.0 + 0.1 * kl - 0.01 * 3.0, rel=1e-5)


def test_aggregation_modes_and_minibatch_normaliser():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(loss_mat, mask).item() == pytest.approx(7 / 3)
    assert aggregate_loss(loss_mat, mask, mode="seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate_loss(loss_mat, mask, mode="seq-mean-token-sum").item() == pytest.approx(3.5)
    # micro-batches normalised by the mini-batch count sum to the mini-batch mean
    parts = [aggregate_loss(loss_mat[i : i + 1], mask[i : i + 1], num_tokens=mask.sum()) for i in range(2)]
    assert sum(parts).item() == pytest.approx(7 / 3)
    parts = [
        aggregate_loss(loss_mat[i : i + 1], mask[i : i + 1], mode="seq-mean-token-mean", num_seqs=2)
        for i in range(2)
    ]
    assert sum(parts).item() == pytest.approx(2.75)
    with pytest.raises(ConfigError, match="token-mean"):
        aggregate_loss(loss_mat, mask, mode="sum")


def test_value_loss_clipping():
    one = torch.ones(1, 1)
    loss, m = value_loss(one * 1.0, one * 0.0, one * 2.0, one, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.5 * 2.25)  # clipped value 0.5 is further from 2
    assert m["critic/vf_clipfrac"].item() == 1.0
    loss, m = value_loss(one * 0.2, one * 0.0, one * 0.0, one, cliprange_value=0.5)
    assert loss.item() == pytest.approx(0.02)
    assert m["critic/vf_clipfrac"].item() == 0.0


def _pair(loss_type, **kw):
    t = torch.tensor
    return dpo_loss(t([-1.0]), t([-2.0]), t([-1.5]), t([-1.5]), beta=0.1, loss_type=loss_type, **kw)


def test_dpo_losses_hand_values():
    # z = (pol_c - pol_r) - (ref_c - ref_r) = 1, beta z = 0.1
    loss, m = _pair("sigmoid")
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.1)), rel=1e-6)
    assert m["rewards/chosen"].item() == pytest.approx(0.05)
    assert m["rewards/rejected"].item() == pytest.approx(-0.05)
    assert m["rewards/accuracies"].item() == 1.0
    assert m["rewards/margins"].item() == pytest.approx(0.1)
    loss, _ = _pair("sigmoid", label_smoothing=0.1)
    expected = 0.9 * math.log(1 + math.exp(-0.1)) + 0.1 * math.log(1 + math.exp(0.1))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert _pair("hinge")[0].item() == pytest.approx(0.9)
    assert _pair("ipo")[0].item() == pytest.approx(16.0)  # (1 - 1/(2*0.1))^2
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # d_c = 0.5, d_r = -0.5, kl_c = 0.5, kl_r = 0
    expected = ((1 - sig(0.1 * 0.5)) + (1 - sig(0.1 * (0.5 + 0.5)))) / 2
    assert _pair("kto_pair")[0].item() == pytest.approx(expected, rel=1e-6)
    loss, _ = _pair("hinge", pref_ftx=0.5, chosen_nll=torch.tensor([2.0]))
    assert loss.item() == pytest.approx(0.9 + 1.0)
    with pytest.raises(ConfigError, match="sigmoid"):
        _pair("simpo")


def test_orpo_is_the_chosen_nll_plus_the_odds_ratio_term():
    # the paper's definition on probabilities: p = exp(mean token log-prob), odds = p / (1 - p)
    p_c, p_r = math.exp(-1.0), math.exp(-2.0)  # _pair's length-averaged policy log-probs
    ratio = (p_c / (1 - p_c)) / (p_r / (1 - p_r))
    expected = 1.0 + 0.1 * -math.log(ratio / (1 + ratio))  # NLL + lambda * -log sigmoid(log odds ratio)
    loss, m = _pair("orpo")
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["rewards/accuracies"].item() == 1.0
    # the reference inputs are not read
    t = torch.tensor
    other, _ = dpo_loss(t([-1.0]), t([-2.0]), t([5.0]), t([-7.0]), beta=0.1, loss_type="orpo")
    assert other.item() == loss.item()
    # stable where the chosen answer is nearly certain (mean log-prob -> 0)
    near, _ = dpo_loss(t([-1e-9]), t([-2.0]), t([0.0]), t([0.0]), beta=0.1, loss_type="orpo")
    assert math.isfinite(near.item())
