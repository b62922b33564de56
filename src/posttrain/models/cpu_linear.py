"""fp32 ``nn.Linear`` on a CPU through oneDNN's GEMM where it beats the BLAS that ``aten::mm`` calls.

PyTorch's CPU build computes an fp32 ``nn.Linear`` with its BLAS (MKL). On some CPUs that BLAS is
far from the hardware: on the AMD EPYC (Zen, AVX-512) of our benchmarks MKL's ``sgemm`` reached
about 200 GFLOP/s on 2 cores where oneDNN's fp32 GEMM, which PyTorch also ships, reached 450 at
the same shapes, in full fp32 (errors against float64 of the same order as MKL's). oneDNN
(``torch.ops.mkldnn._linear_pointwise``, the kernel TorchInductor's CPU backend calls) computes
here the forward ``x W^T + b`` and both backward products (``dy W`` and ``dy^T x``).

:func:`use_cpu_linear` installs it for a run's duration (:func:`set_cpu_linear` for a process that
is the run's, a Ray worker), as ``torch.set_num_threads`` sets threads: every ``nn.Linear`` whose
input and weight are fp32 CPU tensors, outside autocast, then computes through oneDNN; everything
else (bf16 autocast, which already uses oneDNN, GPU tensors, sharded weights) keeps PyTorch's own
forward. Unless ``$POSTTRAIN_CPU_LINEAR`` (``blas`` or ``onednn``) pins it, :func:`resolve_cpu_linear`
times both kernels once per process and thread count and takes oneDNN when it is at least
:data:`FASTER_BY` faster. The run's session chooses it when the run starts (a resumed run keeps the
choice its checkpoint recorded) and every process of the run installs that one choice.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from posttrain.device import best_seconds
from posttrain.errors import ConfigError

KINDS = ("blas", "onednn")
ENV = "POSTTRAIN_CPU_LINEAR"
FASTER_BY = 1.25  # oneDNN must beat the BLAS by this much for auto to take it (a margin over timing noise)
_TORCH_FORWARD = torch.nn.Linear.forward


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` for 2-D ``x [M, K]`` and ``weight [N, K]`` by oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDnnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])
        return _gemm(flat, weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(grad, weight.t()).reshape(x.shape)  # dy W
        if ctx.needs_input_grad[1]:
            grad_w = _gemm(grad.t(), x.reshape(-1, x.shape[-1]).t())  # dy^T x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` by oneDNN, with its gradients (fp32 CPU tensors)."""
    return _OneDnnLinear.apply(x, weight, bias)


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype is torch.float32 and weight.dtype is torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and type(weight.data) is torch.Tensor and x.numel() > 0
            and x.dim() >= 1 and not torch.is_autocast_enabled("cpu"))


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _eligible(x, self.weight):
        return onednn_linear(x, self.weight, self.bias)
    return _TORCH_FORWARD(self, x)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.lru_cache(maxsize=None)
def speedup(threads: int, size: int = 512, seconds: float = 0.15) -> float:
    """oneDNN's fp32 GEMM over the BLAS's, best repeat of each on ``[size, 2 size] x [2 size, 2 size]``
    (measured once per process and thread count); 0 where oneDNN is not available."""
    if not available():
        return 0.0
    x, w = torch.randn(size, 2 * size), torch.randn(2 * size, 2 * size)
    return best_seconds(lambda: x @ w.t(), seconds) / best_seconds(lambda: _gemm(x, w), seconds)


def resolve_cpu_linear(device: str, stored: str | None = None) -> str:
    """The fp32 linear kernel of a run on ``device``: ``$POSTTRAIN_CPU_LINEAR`` when set, else the
    kernel a resumed run ``stored`` in its checkpoint (so it computes as the run it continues), else
    oneDNN on a CPU where it is at least :data:`FASTER_BY` faster than the BLAS (timed now, at
    torch's thread count), else ``blas``."""
    pinned = os.environ.get(ENV, "").strip().lower()
    if pinned:
        if pinned not in KINDS:
            raise ConfigError(f"${ENV}={pinned!r}: use one of {', '.join(KINDS)} (or leave it unset: measured)")
        return pinned if available() or pinned == "blas" else "blas"
    if not device.startswith("cpu"):
        return "blas"
    if stored in KINDS:
        return stored if available() or stored == "blas" else "blas"
    return "onednn" if speedup(torch.get_num_threads()) >= FASTER_BY else "blas"


def set_cpu_linear(kind: str) -> None:
    """Make every fp32 CPU ``nn.Linear`` of this process compute through ``kind`` (blas: PyTorch's own)."""
    torch.nn.Linear.forward = _forward if kind == "onednn" else _TORCH_FORWARD


@contextlib.contextmanager
def use_cpu_linear(kind: str) -> Iterator[None]:
    """``kind`` installed for the ``with`` block; the kernel installed before is restored after."""
    before = torch.nn.Linear.forward
    set_cpu_linear(kind)
    try:
        yield
    finally:
        torch.nn.Linear.forward = before


def installed() -> str:
    """The kernel this process's ``nn.Linear`` computes with now."""
    return "onednn" if torch.nn.Linear.forward is _forward else "blas"
