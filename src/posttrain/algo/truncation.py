"""Log-probs under the truncated sampling distribution (top-k, top-p, min-p).

A sampler that truncates draws token ``y`` from ``mu(y) = p(y) / mass(S)`` on its kept set ``S``
(zero outside), ``p = softmax(z / T)``. The rule, shared by the native sampler
(:mod:`posttrain.rollout.sampling`) and the trainer (``rl_config.truncated_sampling_logprobs``), is
applied in this order:

* top-k (``top_k > 0``): the ``k`` largest logits (``torch.topk``; ties as it breaks them);
* top-p (``top_p < 1``), on the top-k renormalised probabilities sorted descending: token ``i`` is
  kept when the probability mass strictly before it is ``< top_p`` (the first token always is);
* min-p (``min_p > 0``): token ``i`` is kept when ``p_i >= min_p * max_j p_j``.

:func:`truncated_scaled_logprobs` returns ``log mu(y) = z_y - logsumexp_{v in S} z_v``. The kept
set is found without a gradient (it is a step function of the logits); the renormalisation is
differentiable, so the gradient reaches only the kept tokens' logits. The label is always added to
``S``: on-policy it is in it already (it was sampled from ``S``); after an update the trainer's set
may have lost it, and ``S + {y}`` keeps its log-prob finite (the ratio small, not 0 with a NaN
gradient).

Cost: top-k is a ``torch.topk`` per token; top-p a full sort of the vocabulary per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Truncation:
    """The sampling truncation (``generate_config.sampling_config``'s top_k, top_p, min_p)."""

    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def candidates(scaled: torch.Tensor, top_k: int, need_sorted: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The candidate logits [B, K] and their vocab ids [B, K] (None means: all V, in vocab order)."""
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        return torch.topk(scaled, top_k, dim=-1, sorted=True)
    if need_sorted:
        return torch.sort(scaled, dim=-1, descending=True)
    return scaled, None


def filter_candidates(cand: torch.Tensor, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) candidates outside top-p / min-p. ``cand`` is sorted descending when top_p < 1.

    top-p keeps token i when the probability mass strictly before it is < top_p (the first token is
    always kept); min-p keeps token i when ``p_i >= min_p * max_j p_j``.
    """
    if top_p < 1.0:
        probs = torch.softmax(cand, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        cand = cand.masked_fill(mass_before >= top_p, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(cand, dim=-1)
        cutoff = probs.amax(dim=-1, keepdim=True) * min_p
        cand = cand.masked_fill(probs < cutoff, float("-inf"))
    return cand


def kept_mask(scaled: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """Boolean ``[N, V]``: the tokens the sampler may draw from ``scaled`` ``[N, V]`` (no gradient)."""
    with torch.no_grad():
        cand, ids = candidates(scaled, truncation.top_k, need_sorted=truncation.top_p < 1.0)
        kept = filter_candidates(cand, truncation.top_p, truncation.min_p) > float("-inf")
        if ids is None:
            return kept
        return torch.zeros_like(scaled, dtype=torch.bool).scatter_(-1, ids, kept)


def truncate_logits(scaled: torch.Tensor, labels: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """``scaled`` ``[N, V]`` with the tokens outside the kept set (plus each row's label) at -inf."""
    kept = kept_mask(scaled, truncation).scatter_(-1, labels[:, None], True)
    return scaled.masked_fill(~kept, float("-inf"))


def truncated_scaled_logprobs(scaled: torch.Tensor, labels: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """``log mu(labels)`` ``[N]`` under the truncated, renormalised ``softmax(scaled)`` (see the
    module docstring); differentiable through the kept logits."""
    z = truncate_logits(scaled, labels, truncation)
    return z.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)
