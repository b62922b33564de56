"""Test-only shims that let Megatron-Core 0.16.1 run a local-spec ``GPTModel`` on CPU.

Megatron-Core assumes CUDA in a handful of places even when every tensor lives on CPU. Each
shim below names the Megatron call that needs it; ``cpu_megatron()`` installs all of them and
undoes them on exit::

    with cpu_megatron():
        ...  # build GPTModel(use_cpu_initialization=True), run get_forward_backward_func()

Only for tests: never import this from ``src/``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaToCpuMode", "cpu_megatron"]


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrite a ``device="cuda"`` (or ``torch.device("cuda", i)``) keyword argument to ``"cpu"``.

    Needed by Megatron code that hard-codes the device string rather than asking
    ``torch.cuda.current_device()``:

    * ``pipeline_parallel.schedules`` - ``total_num_tokens = torch.zeros([], ..., device="cuda")``
      in every forward/backward schedule (no pipelining, 1F1B, interleaved);
    * ``transformer.utils.get_default_causal_mask`` - ``torch.ones(sq, sq, device="cuda")``
      (only when no explicit attention mask is passed; the harness passes one).

    It also turns ``Tensor.cuda()`` into a no-op: ``LanguageModule.setup_embeddings_and_output_layer``
    does ``weight.data = weight.data.cuda()`` before all-reducing the tied embedding between the
    first and last pipeline stage (tied embeddings with pipeline parallelism).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _current_device() -> str:
    """Stands in for ``torch.cuda.current_device()``.

    Used as a ``device=`` argument by: rotary embedding (``RotaryEmbedding.get_emb`` moves
    ``inv_freq`` to it), ``tensor_parallel.mappings`` all-gathers, ``p2p_communication`` shape
    and receive buffers, ``GlobalMemoryBuffer.get_tensor`` (attention matmul buffer)."""
    return "cpu"


def _synchronize(device=None) -> None:
    """Stands in for ``torch.cuda.synchronize()``: ``p2p_communication`` calls it after the
    pipeline send/recv ops (gloo ops are waited on already)."""


def _null_fork(self, name=None):
    """Stands in for ``CudaRNGStatesTracker.fork()``: ``DotProductAttention.forward`` wraps the
    attention dropout in ``get_cuda_rng_tracker().fork()``, which reads and sets the CUDA
    generator state. Dropout is 0 in the harness, so a null context is exact."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Install the CPU shims for the duration of the block (restored on exit, even on error)."""
    from megatron.core.tensor_parallel import random as mc_random

    saved = [
        (torch.cuda, "current_device", torch.cuda.current_device),
        (torch.cuda, "synchronize", torch.cuda.synchronize),
        (mc_random.CudaRNGStatesTracker, "fork", mc_random.CudaRNGStatesTracker.fork),
    ]
    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    mc_random.CudaRNGStatesTracker.fork = _null_fork
    try:
        with CudaToCpuMode():
            yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
