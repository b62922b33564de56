"""Log-probs through the LM head in chunks, without the full-vocabulary logits of every token.

A response of ``K`` tokens over a vocabulary of ``V`` entries has ``K x V`` logits: for 64 samples
of 64 tokens on SmolLM2 (``V`` = 49,152) that is 800 MB in fp32, and autograd keeps them (and the
log-softmax's inputs) until the backward pass. Here the model's forward returns its final hidden
states instead (:func:`detached_head` swaps the head for an identity during the call), and
:func:`head_logprobs` applies the head to ``chunk`` tokens at a time: each chunk's logits give its
log-probs (and entropies), then are freed. Without autograd (old log-probs, the reference, eval)
that is all: at most one chunk's logits exist at a time. Under autograd the logits are kept for the
backward pass unless they would exceed :data:`RECOMPUTE_ABOVE` elements (1 GiB in fp32): then each
chunk is checkpointed (``torch.utils.checkpoint``, non-reentrant) and the backward pass recomputes
its logits from the saved hidden states and the head's weight, at the cost of one more LM-head
forward. On SmolLM2 that recomputation makes a micro-batch's forward and backward about 10% slower
on a CPU, so it is kept for the micro-batches whose logits would not fit comfortably. The result
equals the unchunked computation up to float rounding (``tests/unit/train/test_lm_head.py``).
Inside :func:`~posttrain.training.fused_regions.fused_regions` (``rl_config.compile_regions``) a
chunk's log-softmax-gather after the matmul runs as a compiled region
(:mod:`posttrain.training.compiled_logprob`), except under a truncated sampling distribution and
for the checkpointed (recomputed) chunks.

The head is detached only from a model whose ``get_output_embeddings()`` is a plain ``nn.Linear``
with ordinary parameters (a Hugging Face causal LM, alone, under DDP or with a PEFT adapter on
other modules); a sharded (FSDP2) model, or one whose head is wrapped (a LoRA head), keeps its
forward and the logits are reduced as before.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from posttrain.algo.logprob import scaled_logprobs_and_entropy, truncated_logprobs_and_entropy
from posttrain.algo.truncation import Truncation
from posttrain.training import compiled_logprob

CHUNK_ELEMENTS = 1 << 25  # logits per chunk (128 MiB in fp32): 682 tokens of a 49,152-entry vocabulary
RECOMPUTE_ABOVE = 1 << 28  # logits of a whole call (1 GiB in fp32) above which autograd recomputes them


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP keeps the model in .module


@contextlib.contextmanager
def detached_head(model: torch.nn.Module) -> Iterator[torch.nn.Linear | None]:
    """Inside, ``model``'s forward returns the final hidden states where it returned logits; yields
    the head to apply, or None (the forward is unchanged) where it cannot be detached."""
    inner = _inner(model)
    get, put = getattr(inner, "get_output_embeddings", None), getattr(inner, "set_output_embeddings", None)
    head = get() if callable(get) and callable(put) else None
    if type(head) is not torch.nn.Linear or any(type(p) is not torch.nn.Parameter for p in head.parameters()):
        yield None
        return
    put(torch.nn.Identity())
    try:
        yield head
    finally:
        put(head)


def scaled_logits(head: torch.nn.Linear, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """``head(hidden) / temperature`` in float32, divided once per chunk for the log-probs and the
    entropies together. (Dividing the hidden states instead would touch H values a token rather
    than V, but rounds differently from Megatron's ``logits / temperature``, and the Megatron engine
    is tested to equal this one.)"""
    z = head(hidden).float()  # a new tensor (the product, or its float32 copy): divided in place
    return z.div_(temperature) if temperature != 1.0 else z


def head_logprobs(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                  *, with_entropy: bool = False, entropy_grad: bool = True,
                  chunk_tokens: int | None = None,
                  truncation: Truncation | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(head(hidden) / temperature)[labels]`` per token, ``[...]`` float32 for ``hidden
    [..., H]`` and ``labels [...]``; with ``with_entropy`` also the entropies (with a gradient only
    when ``entropy_grad``). ``chunk_tokens`` defaults to :data:`CHUNK_ELEMENTS` / V. With an active
    ``truncation`` each chunk's log-probs are those of the truncated sampling distribution
    (:mod:`posttrain.algo.truncation`: a top-k or sort per token, inside the chunk)."""
    shape = labels.shape
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // head.out_features)
    grad = torch.is_grad_enabled()
    recompute = grad and flat_y.shape[0] * head.out_features > RECOMPUTE_ABOVE
    entropy_needs_grad = with_entropy and entropy_grad and grad
    recomputing = [False]  # the checkpoint's backward re-runs `piece`: the no-grad entropy is not redone

    def piece(h: torch.Tensor, y: torch.Tensor):
        entropy = with_entropy and (entropy_needs_grad or not recomputing[0])
        truncated = truncation is not None and truncation.active
        # the compiled log-softmax-gather (fused_regions); not under the checkpoint, whose backward re-runs
        # `piece` without the entropy: another compiled graph, which saves other tensors than the forward's
        if compiled_logprob.active() and not truncated and not recompute:
            return compiled_logprob.compiled_logprobs_and_entropy()(head(h), y, temperature, entropy,
                                                                    entropy_needs_grad)
        z = scaled_logits(head, h, temperature)
        if truncated:
            return truncated_logprobs_and_entropy(z, y, truncation, entropy, entropy_needs_grad)
        return scaled_logprobs_and_entropy(z, y, entropy, entropy_needs_grad)

    logprobs, entropies = [], []
    for start in range(0, flat_y.shape[0], chunk):
        h, y = flat_h[start:start + chunk], flat_y[start:start + chunk]
        if recompute:
            lp, ent = checkpoint(piece, h, y, use_reentrant=False)
        else:
            lp, ent = piece(h, y)
        logprobs.append(lp)
        entropies.append(ent)
    recomputing[0] = True
    entropy = torch.cat(entropies).reshape(shape) if with_entropy else None
    return torch.cat(logprobs).reshape(shape), entropy
