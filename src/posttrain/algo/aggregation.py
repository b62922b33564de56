"""Reduce a per-token loss matrix to a scalar.

``loss_mat [B, T]`` and ``mask [B, T]`` describe one micro-batch. The normaliser can be passed
in so that a mini-batch split into micro-batches gives the same gradient as one big batch:

* ``token-mean``: ``sum(loss * M) / num_tokens``. With ``num_tokens`` = the valid-token count of
  the whole **mini-batch**, summing the micro-batch losses gives the mini-batch token mean, so
  1x8 and 8x1 micro-batching are equivalent. (The seed normalises by the micro-batch's own token
  count and then averages micro-batches, which depends on the micro-batch size; seed quirk 3.)
* ``seq-mean-token-mean``: each row's token mean, summed over rows, divided by ``num_seqs``
  (rows in the mini-batch). The DAPO ``token_level_loss: false`` mode and GSPO's default.
* ``seq-mean-token-sum``: each row's token sum, summed over rows, divided by ``num_seqs``
  (Dr. GRPO's length-unbiased sum; divide the result by a constant length if wanted).
* ``seq-mean-token-sum-norm``: ``sum_i sum_t loss_it / (num_seqs * L)`` with a **constant**
  length ``L = norm_length`` (the generation budget ``max_tokens``; default the padded width
  ``T``). Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") replaces the
  per-response ``1/|o_i|`` of GRPO by this constant, so long wrong answers are not penalised
  less per token than short ones.

When ``num_tokens`` / ``num_seqs`` are None the micro-batch's own counts are used.
"""

from __future__ import annotations

import torch

from posttrain.registry import Registry

AGGREGATIONS = Registry("loss aggregation mode", key="rl_config.loss_agg_mode")


def _safe(count) -> torch.Tensor | float:
    """A positive denominator: an empty batch gives a 0 loss, not NaN."""
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1e-8)
    return max(float(count), 1e-8)


@AGGREGATIONS.register("token-mean")
def _token_mean(loss_mat, mask, num_tokens=None, num_seqs=None, **_):
    total = mask.sum() if num_tokens is None else num_tokens
    return (loss_mat * mask).sum() / _safe(total)


@AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, num_tokens=None, num_seqs=None, **_):
    per_seq = (loss_mat * mask).sum(-1) / mask.sum(-1).clamp(min=1e-8)
    total = loss_mat.shape[0] if num_seqs is None else num_seqs
    return per_seq.sum() / _safe(total)


@AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, num_tokens=None, num_seqs=None, **_):
    total = loss_mat.shape[0] if num_seqs is None else num_seqs
    return (loss_mat * mask).sum() / _safe(total)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, num_tokens=None, num_seqs=None, norm_length=None):
    total = loss_mat.shape[0] if num_seqs is None else num_seqs
    length = loss_mat.shape[-1] if norm_length is None else norm_length
    return (loss_mat * mask).sum() / _safe(total) / _safe(length)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens: torch.Tensor | float | None = None,
    num_seqs: torch.Tensor | float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat [B, T]`` under ``mask`` with the named ``mode`` (see module docstring).

    ``norm_length`` is the constant length of ``seq-mean-token-sum-norm`` (ignored by the others).
    """
    fn = AGGREGATIONS.get(mode)
    mask = mask.to(loss_mat.dtype)
    return fn(loss_mat, mask, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
