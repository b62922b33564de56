"""Prepacked oneDNN weights for the rollout's fp32 ``nn.Linear`` layers on a CPU.

oneDNN computes ``x W^T`` fastest from a weight in its own blocked layout. Given a plain tensor
(:mod:`posttrain.models.cpu_linear`), ``torch.ops.mkldnn._linear_pointwise`` reorders ``W`` on every
call; given a weight reordered once by ``torch.ops.mkldnn._reorder_linear_weight`` (the packing
TorchInductor's CPU backend does when it freezes a model) it reads it as it is. A decode step
multiplies few rows (64 at most, fewer as answers end) by every weight, so the reorder is a large
share of it: on the AMD EPYC (AVX-512) of our benchmarks, 1 thread, SmolLM2-135M's shapes ran
1.08x faster packed at 64 rows, 1.15x at 33 and 1.4-1.9x at 8. The packed product equals the plain
one (bitwise at those shapes; within 5e-6 for one row, where oneDNN picks another kernel).

:class:`PackedLinears` packs a model's eligible layers (fp32 plain CPU weights) and, for the ``with``
block of :meth:`PackedLinears.installed`, gives each of them a forward that multiplies with its packed
weight, with no autograd (the rollout runs under ``inference_mode``). The engine repacks when the
model's weights may have changed (the version it passes, see ``rollout.native``); a pack holds a
second copy of the layers' weights (0.5 GiB for SmolLM2-135M's fp32 layers, LM head included).

Unless ``$POSTTRAIN_ROLLOUT_PACKED`` (``on`` or ``off``) pins it, :func:`resolve_packed` times a
64-row product packed against the fp32 kernel installed now (``cpu_linear``), once per process and
thread count, and packs where that is at least :data:`FASTER_BY` faster.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.device import best_seconds
from posttrain.errors import ConfigError

ENV = "POSTTRAIN_ROLLOUT_PACKED"
CHOICES = {"on": True, "off": False}
FASTER_BY = 1.04  # packed must beat the installed kernel by this much for auto to pack (measured ~1.08-1.5x)
DECODE_ROWS = 64  # the rows of the product timed (a decode step of max_num_seqs' order)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] reordered into oneDNN's layout (an opaque mkldnn tensor of the same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` [..., K] with ``W`` packed by :func:`pack` (no gradient)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], packed.shape[0])


def eligible(module: Any) -> bool:
    """An ``nn.Linear`` whose weight is a plain fp32 CPU tensor (not sharded, not quantised)."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor)
            and type(weight.data) is torch.Tensor and weight.dtype is torch.float32
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.numel() > 0)


@functools.lru_cache(maxsize=None)
def speedup(threads: int, kernel: str, rows: int = DECODE_ROWS, seconds: float = 0.15) -> float:
    """The packed product over the ``kernel`` one (``blas`` or ``onednn``) on ``[rows, 576] x [576, 1536]``
    (a SmolLM2 MLP shape), best repeat of each (measured once per process, thread count and kernel);
    0 where packing is not available."""
    if not available():
        return 0.0
    x, w = torch.randn(rows, 576), torch.randn(1536, 576)
    packed = pack(w)
    if kernel == "onednn":
        def plain():
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    else:
        def plain():
            return x @ w.t()
    with torch.inference_mode():
        return best_seconds(plain, seconds) / best_seconds(lambda: packed_linear(x, packed, None), seconds)


def resolve_packed(device: str) -> bool:
    """Whether the rollout packs its fp32 weights on ``device``: ``$POSTTRAIN_ROLLOUT_PACKED`` when
    set, else on a CPU where packing is at least :data:`FASTER_BY` faster than the fp32 kernel
    installed now (timed at torch's thread count)."""
    from posttrain.models.cpu_linear import installed

    pinned = os.environ.get(ENV, "").strip().lower()
    if pinned:
        if pinned not in CHOICES:
            raise ConfigError(f"${ENV}={pinned!r}: use one of {', '.join(CHOICES)} (or leave it unset: measured)")
        return CHOICES[pinned] and available() and device.startswith("cpu")
    if not device.startswith("cpu"):
        return False
    return speedup(torch.get_num_threads(), installed()) >= FASTER_BY


class PackedLinears:
    """Packed weights of a model's eligible ``nn.Linear`` layers, repacked when ``version`` changes."""

    def __init__(self) -> None:
        self.packs: dict[torch.nn.Linear, torch.Tensor] = {}
        self.version: Any = None
        self.model_id: int | None = None

    def refresh(self, model: torch.nn.Module, version: Any) -> None:
        """Pack ``model``'s eligible layers unless the packs already hold ``version`` of ``model``."""
        if self.model_id == id(model) and self.version == version and self.packs:
            return
        self.packs = {}
        with torch.no_grad():
            for module in model.modules():
                if eligible(module):
                    self.packs[module] = pack(module.weight)
        self.version, self.model_id = version, id(model)

    def clear(self) -> None:
        self.packs, self.version, self.model_id = {}, None, None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Each packed layer multiplies with its pack inside the ``with`` block (fp32 inputs only,
        outside autocast; others take the layer's own forward); the own forwards come back after."""
        patched = []
        for module, packed in self.packs.items():
            if "forward" in vars(module):  # someone else's instance forward: leave the layer alone
                continue
            module.forward = _packed_forward(module, packed)
            patched.append(module)
        try:
            yield
        finally:
            for module in patched:
                del module.forward


def _packed_forward(module: torch.nn.Linear, packed: torch.Tensor):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.float32 and x.device.type == "cpu" and x.numel() > 0 \
                and not torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled():
            return packed_linear(x, packed, module.bias)
        return type(module).forward(module, x)  # the class's forward (cpu_linear's kernel, if installed)

    return forward
