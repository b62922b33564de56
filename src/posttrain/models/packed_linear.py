"""Prepacked oneDNN weights for the rollout's ``nn.Linear`` layers on a CPU (fp32 and bf16).

oneDNN computes ``x W^T`` fastest from a weight in its own blocked layout. Given a plain tensor
(:mod:`posttrain.models.cpu_linear` in fp32, torch's own bf16 linear),
``torch.ops.mkldnn._linear_pointwise`` reorders ``W`` on every call; given a weight reordered once by
``torch.ops.mkldnn._reorder_linear_weight`` (the packing TorchInductor's CPU backend does when it
freezes a model) it reads it as it is. A decode step multiplies few rows (64 at most, fewer as
answers end) by every weight, so the reorder is a large share of it: on the AMD EPYC (AVX-512,
AVX512-BF16) of our benchmarks, 1 thread, SmolLM2-135M's fp32 shapes ran 1.08x faster packed at 64
rows, 1.15x at 33 and 1.4-1.9x at 8 (bf16: 1.07-1.09x at 64 rows, 1.25-1.8x at 16). The packed
product equals the plain one (bitwise at those shapes; within 5e-6 for one fp32 row, where oneDNN
picks another kernel).

:class:`PackedLinears` packs a model's eligible layers (plain fp32 or bf16 CPU weights) and, for the
``with`` block of :meth:`PackedLinears.installed`, gives each of them a forward that multiplies with
its packed weight, with no autograd (the rollout runs under ``inference_mode``). The engine repacks
when the model's weights may have changed (the version it passes, see ``rollout.native``); a pack
holds a second copy of the layers' weights (0.5 GiB for SmolLM2-135M's fp32 layers, LM head included;
half that for the bf16 sampling copy), which a synchronous run frees for its update (:meth:`PackedLinears.clear`,
through ``NativeEngine.drop_sampling_weights``). Layers that read the same input (a decoder layer's q/k/v and
gate/up projections) may be packed as one stacked weight instead (``fuse``), for
:mod:`posttrain.models.lean_forward`.

Unless ``$POSTTRAIN_ROLLOUT_PACKED`` (``on`` or ``off``) pins it, :func:`resolve_packed` times a
64-row product packed against the plain one (in fp32: the run's ``cpu_linear`` kernel), once per
process, thread count and dtype, and packs where that is at least :data:`FASTER_BY` faster. A run
decides once (:func:`rollout_packed_weights`, in the driver), keeps the choice in its checkpoints
and installs it (:func:`set_rollout_packed`) in its process and its Ray workers, so every engine of
the run packs or none does (an installed choice rules over a worker's own ``$POSTTRAIN_ROLLOUT_PACKED``,
which the driver's choice has already read where it was set), and a resumed run keeps the choice: packed
and plain products round differently, so a choice left to each process's timing could change a run's samples.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from posttrain.device import best_seconds
from posttrain.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "POSTTRAIN_ROLLOUT_PACKED"
CHOICES = {"on": True, "off": False}
FASTER_BY = 1.04  # packed must beat the installed kernel by this much for auto to pack (measured ~1.08-1.5x)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the weights it packs
DECODE_ROWS = 64  # the rows of the product timed (a decode step of max_num_seqs' order)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] reordered into oneDNN's layout (an opaque mkldnn tensor of the same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` for ``x`` [..., K] with ``W`` packed by :func:`pack` (no gradient; the
    operator flattens and restores the leading dimensions itself)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def eligible(module: Any) -> bool:
    """An ``nn.Linear`` whose weight is a plain fp32 or bf16 CPU tensor (not sharded, not quantised)."""
    weight = getattr(module, "weight", None)
    return (isinstance(module, torch.nn.Linear) and isinstance(weight, torch.Tensor)
            and type(weight.data) is torch.Tensor and weight.dtype in DTYPES.values()
            and weight.device.type == "cpu" and weight.dim() == 2 and weight.numel() > 0)


@functools.lru_cache(maxsize=None)
def speedup(threads: int, kernel: str, dtype: str = "float32", rows: int = DECODE_ROWS, seconds: float = 0.15) -> float:
    """The packed product over the plain one on ``[rows, 576] x [576, 1536]`` (a SmolLM2 MLP shape) in
    ``dtype``, best repeat of each (measured once per process and argument); the plain one is the fp32
    ``kernel`` (``blas`` or ``onednn``, :mod:`posttrain.models.cpu_linear`) or torch's bf16 linear.
    0 where packing is not available."""
    if not available():
        return 0.0
    x, w = torch.randn(rows, 576, dtype=DTYPES[dtype]), torch.randn(1536, 576, dtype=DTYPES[dtype])
    packed = pack(w)
    if kernel == "onednn" and dtype == "float32":
        def plain():
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    else:
        def plain():
            return torch.nn.functional.linear(x, w)
    with torch.inference_mode():
        ratio = best_seconds(plain, seconds) / best_seconds(lambda: packed_linear(x, packed, None), seconds)
    log.info("rollout: a %d-row %s product on prepacked oneDNN weights ran %.2fx as fast as on %s (%d threads): %s",
             rows, dtype, ratio, kernel if dtype == "float32" else "torch's linear", threads,
             "packing" if ratio >= FASTER_BY else "not packing")
    return ratio


_run_choice: bool | None = None  # the run's choice, installed in this process (set_rollout_packed)


def set_rollout_packed(choice: bool | None) -> None:
    """Make every engine of this process pack (``True``) or not (``False``) where it can, as the run
    decided; ``None``: each engine resolves it (:func:`resolve_packed`)."""
    global _run_choice
    _run_choice = choice


@contextlib.contextmanager
def use_rollout_packed(choice: bool | None) -> Iterator[None]:
    """``choice`` installed for the ``with`` block; the one before is restored after."""
    before = _run_choice
    set_rollout_packed(choice)
    try:
        yield
    finally:
        set_rollout_packed(before)


def can_pack(device: str, dtype: str) -> bool:
    """Whether a rollout in ``dtype`` on ``device`` can run on packed weights (a CPU with oneDNN)."""
    return device.startswith("cpu") and dtype in DTYPES and available()


def install_run_kernels(start: dict) -> None:
    """In a Ray worker, for its life: the run's fp32 linear kernel and packing choice, as its driver
    decided them (``start``: ``cpu_linear``, ``rollout_packed``; ``Session.worker_start``)."""
    from posttrain.models.cpu_linear import set_cpu_linear

    set_cpu_linear(start["cpu_linear"])
    set_rollout_packed(start.get("rollout_packed"))


def _pinned() -> bool | None:
    pinned = os.environ.get(ENV, "").strip().lower()
    if pinned and pinned not in CHOICES:
        raise ConfigError(f"${ENV}={pinned!r}: use one of {', '.join(CHOICES)} (or leave it unset: measured)")
    return CHOICES[pinned] if pinned else None


def resolve_packed(device: str, dtype: str = "float32", kernel: str | None = None) -> bool:
    """Whether a rollout in ``dtype`` (float32 or bfloat16) packs its weights on ``device``: where it
    can, the run's installed choice, else ``$POSTTRAIN_ROLLOUT_PACKED`` when set, else whether packing
    is at least :data:`FASTER_BY` faster than the plain product (the fp32 ``kernel``, by default the
    one installed now; timed at torch's thread count)."""
    if _run_choice is not None:
        return _run_choice and can_pack(device, dtype)
    return _unless_pinned(device, dtype, kernel)


def _unless_pinned(device: str, dtype: str, kernel: str | None, stored: bool | None = None) -> bool:
    """Where packing can run: ``$POSTTRAIN_ROLLOUT_PACKED`` when set, else ``stored`` when given, else
    whether packing is at least :data:`FASTER_BY` faster than the plain product."""
    from posttrain.models.cpu_linear import installed

    if not can_pack(device, dtype):
        return False
    choice = _pinned()
    choice = stored if choice is None else choice
    if choice is not None:
        return bool(choice)
    return speedup(torch.get_num_threads(), kernel or installed(), dtype) >= FASTER_BY


def rollout_packed_weights(plan: Any, kernel: str, stored: bool | None = None) -> bool:
    """The run's choice (recorded in ``run.json`` and its checkpoints): whether its native rollout
    packs its weights: ``$POSTTRAIN_ROLLOUT_PACKED`` when set, else the checkpoint's choice
    (``stored``) on a resume, else measured against the run's fp32 ``kernel`` (never another run's
    choice installed in this process)."""
    rollout = getattr(plan, "rollout", None)
    if rollout is None or rollout.engine != "native":
        return False
    return _unless_pinned(plan.device, plan.rollout_dtype, kernel, stored)


class PackedLinears:
    """Packed weights of a model's eligible ``nn.Linear`` layers, repacked when ``version`` changes.

    ``fused`` (:meth:`refresh`'s ``fuse``): groups of layers that read the same input, each packed as
    one weight with theirs stacked along the outputs, ``(pack, bias or None)`` by group; the members
    of such a group have no pack of their own (``posttrain.models.lean_forward`` runs them)."""

    def __init__(self) -> None:
        self.packs: dict[torch.nn.Linear, torch.Tensor] = {}
        self.fused: dict[tuple[torch.nn.Linear, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.version: Any = None
        self.model_id: int | None = None

    def refresh(self, model: torch.nn.Module, version: Any, fuse: list[tuple[torch.nn.Linear, ...]] = ()) -> None:
        """Pack ``model``'s eligible layers (the groups of ``fuse`` stacked, when all their members
        are eligible) unless the packs already hold ``version`` of ``model``."""
        if self.model_id == id(model) and self.version == version and (self.packs or self.fused):
            return
        self.packs, self.fused = {}, {}
        with torch.no_grad():
            for group in fuse:
                if all(eligible(m) and m.weight.dtype == group[0].weight.dtype for m in group):
                    weight = group[0].weight if len(group) == 1 else torch.cat([m.weight for m in group])
                    self.fused[tuple(group)] = (pack(weight), _stacked_bias(group))
            members = {m for group in self.fused for m in group}
            for module in model.modules():
                if eligible(module) and module not in members:
                    self.packs[module] = pack(module.weight)
        self.version, self.model_id = version, id(model)

    def clear(self) -> None:
        self.packs, self.fused, self.version, self.model_id = {}, {}, None, None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Each packed layer multiplies with its pack inside the ``with`` block (inputs of its weight's
        dtype, outside autocast and autograd; others take the layer's own forward); the own forwards
        come back after."""
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


def _stacked_bias(group: tuple[torch.nn.Linear, ...]) -> torch.Tensor | None:
    """The group's biases stacked as its weights are (zeros for a member without one); None if none has one."""
    if all(m.bias is None for m in group):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in group]).detach()


def _packed_forward(module: torch.nn.Linear, packed: torch.Tensor):
    dtype = module.weight.dtype

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is dtype and x.device.type == "cpu" and x.numel() > 0 \
                and not torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled():
            return packed_linear(x, packed, module.bias)
        return type(module).forward(module, x)  # the class's forward (cpu_linear's kernel, if installed)

    return forward
