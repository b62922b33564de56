"""Masked reductions: hand-checked numbers (seed definitions: +1e-8 mean, unbiased var)."""

import math

import torch

from posttrain.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # valid values 1, 2, 4


def test_masked_sum_and_mean():
    assert masked_sum(X, M).item() == 7.0
    assert torch.allclose(masked_sum(X, M, dim=-1), torch.tensor([3.0, 4.0]))
    assert math.isclose(masked_mean(X, M).item(), 7 / 3, rel_tol=1e-6)
    assert torch.allclose(masked_mean(X, M, dim=-1), torch.tensor([1.5, 4.0]))


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_var_is_unbiased():
    # deviations from 7/3: -4/3, -1/3, 5/3 -> squares sum 42/9; unbiased / 2 = 7/3
    assert math.isclose(masked_var(X, M).item(), 7 / 3, rel_tol=1e-6)
    assert math.isclose(masked_var(X, M, unbiased=False).item(), 14 / 9, rel_tol=1e-6)


def test_masked_var_single_element_is_finite():
    mask = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_var(X, mask).item() == 0.0


def test_masked_whiten_values():
    out = masked_whiten(X, M)
    std = math.sqrt(7 / 3)
    assert math.isclose(out[0, 0].item(), (1 - 7 / 3) / std, rel_tol=1e-5)
    assert math.isclose(out[1, 0].item(), (4 - 7 / 3) / std, rel_tol=1e-5)
    assert abs(masked_mean(out, M).item()) < 1e-6
    assert math.isclose(masked_var(out, M).item(), 1.0, rel_tol=1e-5)
    kept = masked_whiten(X, M, shift_mean=False)
    assert math.isclose(masked_mean(kept, M).item(), 7 / 3, rel_tol=1e-5)
