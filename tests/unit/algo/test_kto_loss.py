"""KTO (Ethayarajh et al. 2024) against hand values and a plain-Python evaluation of the paper's formula.

TRL 1.16 (the benchmark dependency) has no standalone KTO loss function (its KTOTrainer computes
the loss inline from a model's outputs), so the independent reference here is the formula itself,
evaluated row by row with ``math`` in float64, apart from the tensor code.
"""

import math
import random

import pytest
import torch

from posttrain.algo.kto_loss import kto_loss, kto_reference_point, weight_balance_advice


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _formula(pol, ref, desirable, pol_mm, ref_mm, beta, lam_d, lam_u) -> float:
    """Eq. (8) of the paper / TRL's docs, one row at a time in Python floats."""
    z0 = max(0.0, sum(p - r for p, r in zip(pol_mm, ref_mm)) / len(pol_mm))
    total = 0.0
    for p, r, d in zip(pol, ref, desirable):
        reward = p - r
        total += lam_d * (1 - _sigmoid(beta * (reward - z0))) if d else lam_u * (1 - _sigmoid(beta * (z0 - reward)))
    return total / len(pol)


def test_hand_values_float64():
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    z0 = kto_reference_point(t(-2.0, -1.0, -4.0), t(-2.5, -1.2, -4.1))  # mean(0.5, 0.2, 0.1) = 0.8 / 3
    assert z0.item() == pytest.approx(0.8 / 3, rel=1e-12)
    loss, metrics = kto_loss(t(-1.0, -2.0, -3.0), t(-1.5, -1.5, -2.0), t(1, 0, 1), z0, beta=0.5,
                             desirable_weight=2.0, undesirable_weight=1.5)
    # rewards r = 0.5, -0.5, -1.0; z0 = 0.26667
    rows = [2.0 * (1 - _sigmoid(0.5 * (0.5 - 0.8 / 3))), 1.5 * (1 - _sigmoid(0.5 * (0.8 / 3 + 0.5))),
            2.0 * (1 - _sigmoid(0.5 * (-1.0 - 0.8 / 3)))]
    assert loss.item() == pytest.approx(sum(rows) / 3, rel=1e-12)
    # by hand: 2 (1 - sigma(0.11667)) = 0.941732, 1.5 (1 - sigma(0.38333)) = 0.607985,
    # 2 (1 - sigma(-0.63333)) = 1.306486; (0.941732 + 0.607985 + 1.306486) / 3 = 0.952068
    assert loss.item() == pytest.approx(0.952068, abs=2e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.5 * (0.5 - 1.0) / 2, rel=1e-12)
    assert metrics["rewards/rejected"].item() == pytest.approx(0.5 * -0.5, rel=1e-12)


def test_reference_point_is_clamped_at_zero_and_carries_no_gradient():
    pol = torch.tensor([-3.0, -2.0], requires_grad=True)
    assert kto_reference_point(pol, torch.tensor([-1.0, -1.0])).item() == 0.0  # mean -1.5 -> 0
    z0 = kto_reference_point(pol, torch.tensor([-4.0, -2.0]))
    assert z0.item() == pytest.approx(0.5) and not z0.requires_grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_formula_on_random_batches(seed):
    rng = random.Random(seed)
    n, m = 7, 7
    pol, ref = [rng.uniform(-30, -5) for _ in range(n)], [rng.uniform(-30, -5) for _ in range(n)]
    pol_mm, ref_mm = [rng.uniform(-40, -5) for _ in range(m)], [rng.uniform(-40, -5) for _ in range(m)]
    desirable = [rng.random() < 0.6 for _ in range(n)]
    beta, lam_d, lam_u = rng.choice([0.1, 0.5]), rng.uniform(0.5, 2), rng.uniform(0.5, 2)
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    z0 = kto_reference_point(f64(pol_mm), f64(ref_mm))
    loss, _ = kto_loss(f64(pol), f64(ref), f64([float(d) for d in desirable]), z0, beta=beta,
                       desirable_weight=lam_d, undesirable_weight=lam_u)
    assert loss.item() == pytest.approx(_formula(pol, ref, desirable, pol_mm, ref_mm, beta, lam_d, lam_u), rel=1e-12)


def test_gradient_raises_desirable_and_lowers_undesirable_log_probs():
    pol = torch.tensor([-2.0, -2.0], requires_grad=True)
    loss, _ = kto_loss(pol, torch.tensor([-2.0, -2.0]), torch.tensor([1.0, 0.0]), 0.3, beta=0.1)
    loss.backward()
    assert pol.grad[0] < 0 < pol.grad[1]  # descent raises the desirable row's log-prob, lowers the other's
    # d/dr of lambda (1 - sigma(beta (r - z0))) / N = -lambda beta sigma (1 - sigma) / N
    s = _sigmoid(0.1 * (0.0 - 0.3))
    assert pol.grad[0].item() == pytest.approx(-0.1 * s * (1 - s) / 2, rel=1e-5)


def test_micro_batch_shares_add_up_to_the_batch():
    torch.manual_seed(0)
    pol, ref = torch.randn(6) - 10, torch.randn(6) - 10
    desirable = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    whole, m_whole = kto_loss(pol, ref, desirable, 0.2, beta=0.5)
    parts = [kto_loss(pol[s], ref[s], desirable[s], 0.2, beta=0.5, num_rows=6, num_desirable=4, num_undesirable=2)
             for s in (slice(0, 2), slice(2, 6))]
    assert sum(p[0] for p in parts).item() == pytest.approx(whole.item(), rel=1e-6)
    for key in ("rewards/chosen", "rewards/rejected"):
        assert sum(p[1][key] for p in parts).item() == pytest.approx(m_whole[key].item(), rel=1e-6)


def test_weight_balance_advice_follows_the_papers_range():
    assert weight_balance_advice(100, 100, 1.0, 1.0) is None  # balance 1
    assert weight_balance_advice(130, 100, 1.0, 1.0) is None  # 1.3 <= 4/3
    low = weight_balance_advice(100, 400, 1.0, 1.0)  # 0.25: the desirable rows weigh too little
    assert "= 0.250, outside the paper's advised range [1, 4/3]" in low
    assert "kto_desirable_weight in [4, 5.33]" in low
    assert weight_balance_advice(100, 400, 4.0, 1.0) is None
    assert weight_balance_advice(0, 10, 1.0, 1.0) is None  # one class only: no ratio
