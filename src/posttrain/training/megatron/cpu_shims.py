"""Shims that let Megatron-Core 0.16.1 run a local-spec ``GPTModel`` on a CPU with gloo.

Megatron-Core assumes CUDA in a handful of places even when every tensor lives on the CPU. Each
shim below names the Megatron call that needs it; ``cpu_megatron()`` installs all of them and
undoes them on exit, so they are active only around Megatron calls (a process-wide
``TorchFunctionMode`` would slow every torch call, the rollout's included)::

    with cpu_megatron():
        ...  # build GPTModel(use_cpu_initialization=True), run get_forward_backward_func()

What still needs CUDA after these (benchmarks/megatron/spike_cpu_training.py, docs/parallelism.md):
the distributed optimizer (its buffers check for CUDA tensor types).
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


def _cpu_rng_state(device=-1, clone=False, graph_safe=False):
    """Stands in for ``tensor_parallel.random._get_cuda_rng_state``: the tracker's ``add`` and
    activation recompute (``CheckpointFunction``) save and restore the CUDA generator's state; on a
    CPU the default generator's state is the one the forward's random ops use."""
    return torch.get_rng_state()


def _cuda_get_rng_state_on_cpu(device="cuda"):
    """Stands in for ``torch.cuda.get_rng_state``, which ``CudaRNGStatesTracker.add`` calls directly."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    """Stands in for ``tensor_parallel.random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def _clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Stands in for ``optimizer.clip_grads.clip_grad_by_total_norm_fp32``, which asserts CUDA
    gradients and scales them with a CUDA overflow buffer: the same scaling on any device."""
    grads = [getattr(p, "decoupled_grad" if use_decoupled_grad else "grad") for p in parameters]
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _null_fork(self, name=None):
    """Stands in for ``CudaRNGStatesTracker.fork()``: ``DotProductAttention.forward`` wraps the
    attention dropout in ``get_cuda_rng_tracker().fork()``, which reads and sets the CUDA
    generator state. Dropout is 0 in the harness, so a null context is exact."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Install the CPU shims for the duration of the block (restored on exit, even on error)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mc_optimizer
    from megatron.core.tensor_parallel import random as mc_random

    replaced = [
        (torch.cuda, "current_device", _current_device),
        (torch.cuda, "synchronize", _synchronize),
        (torch.cuda, "manual_seed", torch.manual_seed),  # the device generator is the CPU's here
        (torch.cuda, "get_rng_state", _cuda_get_rng_state_on_cpu),
        (mc_random.CudaRNGStatesTracker, "fork", _null_fork),
        (mc_random, "_get_cuda_rng_state", _cpu_rng_state),
        (mc_random, "_set_cuda_rng_state", _set_cpu_rng_state),
        (clip_grads, "clip_grad_by_total_norm_fp32", _clip_by_total_norm),
        (mc_optimizer, "clip_grad_by_total_norm_fp32", _clip_by_total_norm),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    for owner, name, value in replaced:
        setattr(owner, name, value)
    try:
        with CudaToCpuMode():
            yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
