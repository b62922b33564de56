"""The packed attention's SDPA call on a CPU (issue 43): causal without a mask, GQA inside SDPA, and
bf16 computed in fp32 on CPUs without AMX.

The packed path (:mod:`posttrain.training.remove_padding`) runs one SDPA per block of rows of similar
length. Its general form passes a boolean ``causal & key-padding`` mask and repeats the key/value
heads (``repeat_interleave``) to the query heads. On a CPU this module runs the same attention as:

* ``is_causal=True`` and no mask. Exact: a row's real slots are a prefix of it, so under the causal
  mask a real query never sees a padding key; a padding query sees some (finite values gathered from
  other positions), but its output is never read, so it sends no gradient back either;
* ``enable_gqa=True`` instead of copying the key/value heads;
* bf16 (a bf16 model, or bf16 autocast, which casts SDPA's inputs) computed in fp32, the output cast
  back to bf16: ATen's CPU flash-attention kernels run bf16 through AMX tiles where the CPU has them
  and much slower than fp32 where it has not.

Measured on the chat workload's blocks (``benchmarks/attention_kernels.py``; SmolLM2-135M's 9 query
and 3 key/value heads of 64, blocks [34, 67], [28, 74], [2, 118]; AMD EPYC with AVX512-BF16 and no
AMX, 1 thread, torch 2.13): forward + backward 2.2-2.8x faster in bf16 and 1.09-1.37x in fp32; the
SDPA kernel is ``_scaled_dot_product_flash_attention_for_cpu`` either way. The bf16 result is closer
to the fp32 one than bf16 SDPA's (it rounds once, at the output).

``$POSTTRAIN_CPU_ATTENTION`` = ``off`` keeps the general form (the path before issue 43), ``on`` (the
default) this one. Other devices always take the general form. The rule is fixed per machine (its
CPU flags), so every process of a run computes alike.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from posttrain.errors import ConfigError

ENV = "POSTTRAIN_CPU_ATTENTION"
CHOICES = {"on": True, "off": False}


def enabled(device: torch.device) -> bool:
    """Whether the packed attention on ``device`` takes this module's path (``$POSTTRAIN_CPU_ATTENTION``)."""
    pinned = os.environ.get(ENV, "").strip().lower()
    if pinned and pinned not in CHOICES:
        raise ConfigError(f"${ENV}={pinned!r}: use on (causal, GQA in SDPA, bf16 in fp32 without AMX) "
                          "or off (the general masked SDPA), or leave it unset (on)")
    return device.type == "cpu" and CHOICES.get(pinned, True)


@functools.lru_cache(maxsize=None)
def bf16_in_fp32() -> bool:
    """bf16 attention computed in fp32: on a CPU without AMX tiles (where the bf16 kernels are slower)."""
    has_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # torch >= 2.3; without it: assume none
    return not (has_amx is not None and has_amx())


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype SDPA computes in for inputs that SDPA would see in ``dtype``."""
    return torch.float32 if dtype == torch.bfloat16 and bf16_in_fp32() else dtype


def causal_block_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
                      scale: float | None) -> torch.Tensor:
    """Causal SDPA of ``q [B, H, L, D]`` over ``k/v [B, H_kv, L, D]`` (``H`` a multiple of ``H_kv``),
    in :func:`compute_dtype`; the output ``[B, H, L, D]`` in the dtype the plain call returns (the
    autocast dtype under CPU autocast, else ``q``'s)."""
    out_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    dtype = compute_dtype(out_dtype)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), dropout_p=dropout,
                                             is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.to(out_dtype)
