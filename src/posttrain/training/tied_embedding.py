"""A tied input embedding's gradient as a sparse update, in a CPU update on one process.

Where the input embedding shares its weight with the LM head (SmolLM2, Qwen2.5 up to 3B), the
weight's gradient is the head's dense ``[V, H]`` product plus the embedding's: autograd's dense
embedding backward zero-fills a second ``[V, H]`` tensor, adds each token's row into it, and the
accumulation then adds that whole tensor to the head's. With ``nn.Embedding.sparse`` the embedding
sends only its tokens' rows (a sparse tensor), which the accumulation adds into the head's dense
gradient in place: the weight's gradient ends dense, as before, and equal up to the order of
float additions (``tests/unit/train/test_tied_embedding.py``). On the chat update (SmolLM2-135M,
V = 49,152, 1 thread) that removed two passes over 113 MB, about 90 ms a step.

Only where nothing else reads the embedding's own gradient: a CPU model on one process (no DDP/FSDP
reduction), not wrapped, a plain ``nn.Embedding`` whose trainable ``nn.Parameter`` is the output
embedding's weight. A gradient left sparse (the embedding's rows accumulated first: a loss that
skips the head) is made dense as it accumulates, so the optimizer always sees a dense one.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def tied_embedding(model: torch.nn.Module) -> torch.nn.Embedding | None:
    """``model``'s input embedding where the sparse gradient applies (see the module), else None."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if hasattr(model, "module") or not callable(get_in) or not callable(get_out):
        return None
    embed, head = get_in(), get_out()
    if type(embed) is not torch.nn.Embedding or head is None:
        return None
    weight = embed.weight
    if type(weight) is not torch.nn.Parameter or not weight.requires_grad or weight.device.type != "cpu":
        return None
    return embed if getattr(head, "weight", None) is weight else None


@contextlib.contextmanager
def sparse_embedding_grad(model: torch.nn.Module) -> Iterator[bool]:
    """Inside, a tied embedding (:func:`tied_embedding`) sends a sparse gradient; yields whether it does."""
    embed = tied_embedding(model)
    if embed is None or embed.sparse:
        yield False
        return
    embed.sparse = True
    # should the embedding's rows come first (a loss that skips the head), the sum would stay sparse
    handle = embed.weight.register_post_accumulate_grad_hook(_dense_grad)
    try:
        yield True
    finally:
        embed.sparse = False
        handle.remove()


def _dense_grad(weight: torch.Tensor) -> None:
    if weight.grad is not None and weight.grad.is_sparse:
        weight.grad = weight.grad.to_dense()
