"""Per-token log-probabilities and entropies from logits.

Shapes: ``logits [B, T, V]``, ``labels [B, T]`` (int64), results ``[B, T]`` in float32.

Both functions divide the logits by the sampling ``temperature`` first, as the seed does for the
actor and the reference (``output.div_(temperature)``), so that the training-side log-prob of a
token equals the sampler's log-prob of the same token.

Memory: ``log_softmax`` would materialise a second ``[B, T, V]`` tensor. Instead
``log p(y) = z_y - logsumexp(z)`` gathers one logit per token and reduces the vocabulary once.
Low-precision logits (bf16/fp16) are upcast to float32 one row-chunk at a time, so the float32
copy never exceeds ``chunk_tokens x V``.
"""

from __future__ import annotations

import torch

from posttrain.algo.truncation import Truncation, truncate_logits, truncated_scaled_logprobs

DEFAULT_CHUNK_TOKENS = 4096


def _scaled_chunks(logits: torch.Tensor, temperature: float, chunk_tokens: int):
    """Yield ``(start, end, z)`` with ``z`` the float32, temperature-scaled logits of rows start:end."""
    flat = logits.reshape(-1, logits.shape[-1])
    for start in range(0, flat.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, flat.shape[0])
        z = flat[start:end].float()
        if temperature != 1.0:
            z = z / temperature
        yield start, end, z


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """``log softmax(logits / temperature)[labels]`` per token.

    ``log p_t = z_{t, y_t} - logsumexp_v z_{t, v}`` with ``z = logits / temperature`` in float32.
    With an active ``truncation`` the logsumexp runs over the sampler's kept set only
    (:func:`~posttrain.algo.truncation.truncated_scaled_logprobs`). Differentiable. Returns
    ``[B, T]`` float32.
    """
    assert temperature > 0, "temperature must be positive"
    flat_labels = labels.reshape(-1)
    pieces = []
    for start, end, z in _scaled_chunks(logits, temperature, chunk_tokens):
        if truncation is not None and truncation.active:
            pieces.append(truncated_scaled_logprobs(z, flat_labels[start:end], truncation))
            continue
        picked = torch.gather(z, -1, flat_labels[start:end, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(z, dim=-1))
    return torch.cat(pieces).reshape(labels.shape)


class _LabelLogProb(torch.autograd.Function):
    """``log softmax(z)[labels]`` (and, without a gradient, the entropy of ``softmax(z)``), whose
    backward reuses the forward's softmax: ``dz = g * (onehot(labels) - softmax(z))``, one pass
    over the vocabulary. Autograd's logsumexp and gather backward rebuild ``exp(z - lse)`` in
    three passes and zero-fill a full-size tensor for the gather, per chunk of tokens."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
        lse = torch.logsumexp(z, dim=-1)
        probs = (z - lse[:, None]).exp_()
        ctx.save_for_backward(probs, labels)
        logprobs = torch.gather(z, -1, labels[:, None]).squeeze(-1) - lse
        if not with_entropy:
            return logprobs, None
        entropy = lse - (probs * z).sum(dim=-1)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _entropy_grad):
        probs, labels = ctx.saved_tensors
        dz = probs * -grad[:, None]
        dz.scatter_add_(-1, labels[:, None], grad[:, None])
        return dz, None, None


def scaled_logprobs_and_entropy(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool = True,
                                entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels [N]`` and (``with_entropy``) entropies under ``softmax(z)``, for
    ``z [N, V]`` float32 logits already divided by the temperature: the formulas of
    :func:`logprobs_from_logits` and :func:`entropy_from_logits`, sharing one logsumexp. The
    log-probs are differentiable; the entropies only with ``entropy_grad``."""
    grad = torch.is_grad_enabled() and z.requires_grad
    if grad and not (with_entropy and entropy_grad):
        return _LabelLogProb.apply(z, labels, with_entropy)
    lse = torch.logsumexp(z, dim=-1)
    logprobs = torch.gather(z, -1, labels[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, None
    return logprobs, lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def truncated_logprobs_and_entropy(z: torch.Tensor, labels: torch.Tensor, truncation: Truncation,
                                   with_entropy: bool = True, entropy_grad: bool = True
                                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`scaled_logprobs_and_entropy` with the log-probs under the truncated sampling
    distribution; the entropy stays the full distribution's (the policy's, as without truncation).
    Under autograd the truncated log-softmax runs through :class:`_LabelLogProb` (one pass over the
    vocabulary backward; zero outside the kept set)."""
    if torch.is_grad_enabled() and z.requires_grad:
        logprobs = _LabelLogProb.apply(truncate_logits(z, labels, truncation), labels, False)[0]
    else:
        logprobs = truncated_scaled_logprobs(z, labels, truncation)
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logprobs, entropy


def entropy_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per token.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` (the seed's formula). Returns ``[B, T]``
    float32, differentiable.
    """
    assert temperature > 0, "temperature must be positive"
    pieces = []
    for _, _, z in _scaled_chunks(logits, temperature, chunk_tokens):
        probs = torch.softmax(z, dim=-1)
        pieces.append(torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1))
    return torch.cat(pieces).reshape(logits.shape[:-1])
