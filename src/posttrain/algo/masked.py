"""Masked reductions over token tensors.

``mask`` is 1 for valid tokens and 0 for padding, broadcastable to ``x`` (usually both ``[B, T]``).
The seed's definitions (MindSpeed-RL ``utils/torch_functional.py``) are kept exactly:

* ``masked_mean(x, M) = sum(x * M) / (sum(M) + 1e-8)``
* ``masked_var`` is Bessel-corrected (unbiased): ``mean((x - mean)^2) * N / (N - 1)``
* ``masked_whiten(x) = (x - mean) * rsqrt(var + 1e-8)``
"""

from __future__ import annotations

import torch

MEAN_EPS = 1e-8
WHITEN_EPS = 1e-8


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all elements when ``dim`` is None)."""
    prod = x * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask) / (sum(mask) + 1e-8)`` over ``dim`` (all elements when None).

    A fully masked input gives 0, not NaN.
    """
    return masked_sum(x, mask, dim) / (masked_sum(torch.ones_like(x), mask, dim) + MEAN_EPS)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid elements of ``x`` (a scalar).

    ``var = masked_mean((x - masked_mean(x))^2)``, multiplied by ``N / (N - 1)`` (Bessel's
    correction, as the seed) when ``unbiased`` and ``N = sum(mask) > 1``. With a single valid
    element the correction is skipped (the seed raises there; posttrain returns the biased 0).
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = masked_sum(torch.ones_like(x), mask)
        if count > 1:
            var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise the valid elements to zero mean and unit variance.

    ``(x - mean) * rsqrt(var + 1e-8)`` with the unbiased ``masked_var``; when ``shift_mean`` is
    False the mean is added back (only the scale changes). Padding positions are not zeroed:
    multiply by ``mask`` if they must be.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean
