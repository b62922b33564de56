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


def _label_log_softmax(z: torch.Tensor, labels: torch.Tensor):
    """``(log softmax(z)[labels], w, total)`` for ``z [N, V]``, with ``w = exp(log_softmax(z))`` and
    ``total`` its row sums (1 up to rounding: ``softmax(z) = w / total``).

    ``log_softmax`` reads the logits once (the max, the exponentials' sum and the subtraction of
    each row run while the row is in cache), where ``z - logsumexp(z)`` and ``exp(z - lse)`` took
    six passes over ``[N, V]``; but it accumulates the row's sum in one float32 loop, which over
    49,152 entries leaves the log-probs off by up to about 1e-5, the same for a whole row.
    ``total`` (``torch.sum``'s cascaded summation) measures that error, and ``log(total)`` removes
    it: the log-probs are as close to float64's as ``z - logsumexp(z)`` was (a few 1e-6)."""
    w = torch.log_softmax(z, dim=-1)
    picked = w.gather(-1, labels[:, None]).squeeze(-1)
    w = w.exp_()
    total = w.sum(dim=-1)
    return picked - total.log(), w, total


def _entropy(z: torch.Tensor, labels: torch.Tensor, logprobs: torch.Tensor, w: torch.Tensor,
             total: torch.Tensor) -> torch.Tensor:
    """``logsumexp(z) - sum_v softmax(z)_v z_v`` from :func:`_label_log_softmax`'s parts (the
    logsumexp is ``z_y - log p(y)``)."""
    lse = z.gather(-1, labels[:, None]).squeeze(-1) - logprobs
    return lse - (w * z).sum(dim=-1) / total


class _LabelLogProb(torch.autograd.Function):
    """``log softmax(z)[labels]`` (and, without a gradient, the entropy of ``softmax(z)``), whose
    backward reuses the forward's probabilities: ``dz = g * (onehot(labels) - softmax(z))``, one
    pass over the vocabulary. Autograd's logsumexp and gather backward rebuild ``exp(z - lse)`` in
    three passes and zero-fill a full-size tensor for the gather, per chunk of tokens."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, labels: torch.Tensor, with_entropy: bool, temperature: float = 1.0):
        z = z / temperature if temperature != 1.0 else z  # the division's gradient folds into backward's
        logprobs, w, total = _label_log_softmax(z, labels)
        ctx.save_for_backward(w, labels, total)
        ctx.temperature = temperature
        if not with_entropy:
            return logprobs, None
        entropy = _entropy(z, labels, logprobs, w, total)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _entropy_grad):
        w, labels, total = ctx.saved_tensors
        grad = grad / ctx.temperature if ctx.temperature != 1.0 else grad
        dz = w * (-grad / total)[:, None]
        dz.scatter_add_(-1, labels[:, None], grad[:, None])
        return dz, None, None, None


def scaled_logprobs_and_entropy(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool = True,
                                entropy_grad: bool = True, temperature: float = 1.0
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels [N]`` and (``with_entropy``) entropies under ``softmax(z / temperature)``,
    for ``z [N, V]`` float32 logits (``temperature`` 1: already divided): the formulas of
    :func:`logprobs_from_logits` and :func:`entropy_from_logits`, sharing one normaliser. The
    log-probs are differentiable; the entropies only with ``entropy_grad``."""
    grad = torch.is_grad_enabled() and z.requires_grad
    if grad and not (with_entropy and entropy_grad):
        return _LabelLogProb.apply(z, labels, with_entropy, temperature)
    z = z / temperature if temperature != 1.0 else z
    if not grad:
        logprobs, w, total = _label_log_softmax(z, labels)
        return logprobs, _entropy(z, labels, logprobs, w, total) if with_entropy else None
    lse = torch.logsumexp(z, dim=-1)
    logprobs = torch.gather(z, -1, labels[:, None]).squeeze(-1) - lse
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
