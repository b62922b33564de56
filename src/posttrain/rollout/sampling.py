"""Next-token sampling on the last-step logits, with the logprob of the sampled token.

For logits ``z`` (one row, vocab V) and temperature ``T > 0`` the reported logprob of token ``y`` is

    logprob(y) = z_y / T - logsumexp(z / T)

over the full vocabulary: the same number the training side computes as
``log_softmax(logits / T).gather(y)``. The token itself is drawn from the tempered distribution
truncated, in this order, by top-k, top-p (on the top-k renormalised probabilities) and min-p
(``p < min_p * max p`` dropped), then renormalised (:mod:`posttrain.algo.truncation`). With
truncation on, the reported logprob is by default the untruncated one (lower than the log of the
truncated probability by ``log(kept mass)``), the trainer's default; with
``SamplingParams.truncated_logprobs`` (``rl_config.truncated_sampling_logprobs``) it is the log of
the truncated, renormalised probability ``log mu(y)`` the token was actually drawn with. ``T = 0`` is greedy (argmax) and
reports ``log_softmax(z)`` (temperature 1).

The draw is an inverse CDF: each row brings one uniform ``u`` in [0, 1) (from the keyed stream of
:mod:`posttrain.rollout.keyed`), and the token is the first candidate whose cumulative probability
exceeds ``u``, the candidates taken in a deterministic order (top-k/top-p: descending logit, as
``torch.topk``/``torch.sort`` return them; otherwise vocabulary order). A row's token therefore
depends only on its own logits and its own uniform, not on the other rows of the batch.
"""

from __future__ import annotations

import torch

from posttrain.algo.truncation import Truncation, candidates, filter_candidates
from posttrain.rollout.base import SamplingParams


def _token_logprob(scaled: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``scaled[b, tokens[b]] - logsumexp(scaled[b])`` for each row b: [B]."""
    picked = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


# Rows of at least BLOCKED_FROM entries are drawn by blocks of CDF_BLOCK (one float64 pass of block
# sums, then a cumulative sum inside the one block that holds the target), not by a float64 copy and
# cumulative sum of the whole row.
CDF_BLOCK = 1024
BLOCKED_FROM = 4 * CDF_BLOCK


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index [B] of the first entry of each row of ``probs`` [B, K] whose cumulative sum exceeds
    ``uniforms[b] * total[b]`` (``total`` = the row's sum, so rows need not be normalised).

    Entries with zero probability are never chosen: if rounding puts the target at the row's total,
    the index is clamped to the last entry with positive probability. The cumulative sums are taken
    in float64, the precision of the 53-bit uniforms.
    """
    if probs.shape[-1] < BLOCKED_FROM:
        return _inverse_cdf_flat(probs, uniforms)
    return _inverse_cdf_blocked(probs, uniforms)


def _inverse_cdf_flat(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # A zero entry never raises the cdf, so the first entry exceeding the target has positive
    # probability whenever there is one: only an index past the end (rounding put the target at the
    # total) needs the clamp, and the pass over the row that finds its last positive entry runs only then.
    past_end = index >= probs.shape[-1]
    if bool(past_end.any()):
        last_valid = (probs > 0).cumsum(dim=-1).argmax(dim=-1)  # the first index reaching the final count
        index = torch.where(past_end, last_valid, index)
    return index


def _inverse_cdf_blocked(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`inverse_cdf` by blocks. A row whose target rounding puts outside the block found (the
    block sums and the cumulative sum inside a block add in different orders; u near 1) is drawn
    flat."""
    rows, width = probs.shape
    padding = -width % CDF_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, padding)) if padding else probs).view(rows, -1, CDF_BLOCK)
    block_sums = blocks.sum(dim=-1, dtype=torch.float64)
    block_cdf = block_sums.cumsum(dim=-1)
    target = uniforms.to(torch.float64)[:, None] * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[-1] - 1)
    before = (block_cdf.gather(-1, block) - block_sums.gather(-1, block)).squeeze(-1)
    block = block.squeeze(-1)
    inside = blocks[torch.arange(rows), block].double().cumsum(dim=-1) + before[:, None]
    offset = torch.searchsorted(inside, target, right=True).squeeze(-1)
    index = block * CDF_BLOCK + offset
    astray = (offset >= CDF_BLOCK) | (index >= width) | (target.squeeze(-1) < before)
    if bool(astray.any()):
        index[astray] = _inverse_cdf_flat(probs[astray], uniforms[astray])
    return index


def sample_next(logits: torch.Tensor, sampling: SamplingParams,
                uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits`` [B, V] with one uniform per row (``uniforms`` [B];
    unused and may be None when greedy); return (tokens [B] long, logprobs [B] float32)."""
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, _token_logprob(logits, tokens)
    if uniforms is None or uniforms.shape != logits.shape[:1]:
        raise ValueError(f"sample_next needs one uniform per row: {logits.shape[0]} rows, "
                         f"got {None if uniforms is None else tuple(uniforms.shape)}")
    if not Truncation(sampling.top_k, sampling.top_p, sampling.min_p).active:
        return _sample_untruncated(logits, sampling.temperature, uniforms)
    scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    cand, cand_ids = candidates(scaled, sampling.top_k, need_sorted=sampling.top_p < 1.0)
    cand = filter_candidates(cand, sampling.top_p, sampling.min_p)
    probs = torch.softmax(cand, dim=-1)
    choice = inverse_cdf(probs, uniforms)
    tokens = choice if cand_ids is None else cand_ids.gather(-1, choice[:, None]).squeeze(-1)
    if sampling.truncated_logprobs:  # log mu(y): the kept candidates' logsumexp renormalises
        return tokens, cand.gather(-1, choice[:, None]).squeeze(-1) - torch.logsumexp(cand, dim=-1)
    return tokens, _token_logprob(scaled, tokens)


def _sample_untruncated(logits: torch.Tensor, temperature: float,
                        uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw from ``softmax(logits / T)`` and its logprob from one pass of ``exp``: the weights
    ``exp((logits - max) / T)`` are the draw's, unnormalised, and their sum is the logprob's normaliser."""
    peak = logits.amax(dim=-1, keepdim=True)
    weights = (logits - peak).div_(temperature).exp_()
    tokens = inverse_cdf(weights, uniforms)
    log_total = weights.sum(dim=-1, dtype=torch.float64).log()
    picked = (logits.gather(-1, tokens[:, None]) - peak).squeeze(-1) / temperature
    return tokens, (picked.double() - log_total).float()
