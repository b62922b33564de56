"""SDPA on a CPU (issue 43): the packed attention's blocks causal without a mask, GQA inside SDPA, and
bf16 computed in fp32 on CPUs without AMX; the rollout's one-token queries without a mask as
``pack_gqa``.

The packed path (:mod:`posttrain.training.remove_padding`) runs one SDPA per block of rows of similar
length. Its general form passes a boolean ``causal & key-padding`` mask and repeats the key/value
heads (``repeat_interleave``) to the query heads. On a CPU this module runs the same attention as:

* ``is_causal=True`` and no mask. Exact: a row's real slots are a prefix of it, so under the causal
  mask a real query never sees a padding key; a padding query sees some (finite values gathered from
  other positions), but its output is never read, so it sends no gradient back either (a suffix
  block, whose queries are only a shared prompt's later samples' responses, keeps its boolean mask:
  causal by slot, so not ``is_causal``'s top-left alignment);
* ``enable_gqa=True`` instead of copying the key/value heads;
* bf16 (a bf16 model, or bf16 autocast, which casts SDPA's inputs) computed in fp32, the output cast
  back to bf16: ATen's CPU flash-attention kernels run bf16 through AMX tiles where the CPU has them
  and much slower than fp32 where it has not.

Measured on the chat workload's blocks (``benchmarks/attention_kernels.py``; SmolLM2-135M's 9 query
and 3 key/value heads of 64, blocks [34, 67], [28, 74], [2, 118]; AMD EPYC with AVX512-BF16 and no
AMX, 1 thread, torch 2.13): forward + backward 2.2-2.8x faster in bf16 and 1.09-1.37x in fp32; the
SDPA kernel is ``_scaled_dot_product_flash_attention_for_cpu`` either way. The bf16 result is closer
to the fp32 one than bf16 SDPA's (it rounds once, at the output).

**The rollout's decode** (:func:`decode_sdpa`; the models the native engine samples from, and the
packed attention's unpacked forwards): transformers runs a one-token query's GQA with ``enable_gqa=True``
when the batch needs no mask (no row padded: prompts of one length, or one prompt's samples) and as
``pack_gqa`` (the 3 query heads of a key/value head as 3 query rows, no copy) when it does. The
first is far slower in bf16 on a CPU: SmolLM2-135M's heads, 64 rows, 60 / 118 cache columns, 1
thread: 3.6 / 7.1 ms in bf16, 0.60 / 1.00 ms in fp32, against 0.78 / 1.21 ms (bf16) with
``pack_gqa``. Here a one-token query without a mask runs as ``pack_gqa`` too (exact: the same
softmax over the same keys per query head).

``$POSTTRAIN_CPU_ATTENTION`` = ``off`` keeps the general forms (the paths before issue 43), ``on`` (the
default) these. Other devices always take the general form. The rule is fixed per machine (its
CPU flags), so every process of a run computes alike.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from posttrain.errors import ConfigError

ENV = "POSTTRAIN_CPU_ATTENTION"
CHOICES = {"on": True, "off": False}
DECODE_SDPA = "posttrain_sdpa"  # the name decode_sdpa is registered under (AttentionInterface)


def enabled(device: torch.device) -> bool:
    """Whether attention on ``device`` takes this module's paths (``$POSTTRAIN_CPU_ATTENTION``)."""
    pinned = os.environ.get(ENV, "").strip().lower()
    if pinned and pinned not in CHOICES:
        raise ConfigError(f"${ENV}={pinned!r}: use on (packed blocks causal with GQA in SDPA, bf16 in fp32 "
                          "without AMX; the decode's unmasked queries as pack_gqa) or off (transformers' and "
                          "the general masked SDPA), or leave it unset (on)")
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
                      scale: float | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal SDPA of ``q [B, H, Q, D]`` over ``k/v [B, H_kv, L, D]`` (``H`` a multiple of ``H_kv``), in
    :func:`compute_dtype`; the output ``[B, H, Q, D]`` in the dtype the plain call returns (the
    autocast dtype under CPU autocast, else ``q``'s). Without ``mask`` (``Q = L``) ``is_causal``;
    with one (a boolean ``[B, 1, Q, L]``: queries that are a suffix of the keys) that mask."""
    out_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    dtype = compute_dtype(out_dtype)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                             dropout_p=dropout, is_causal=mask is None, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return out.to(out_dtype)


# ---- the rollout's decode ------------------------------------------------------------------------
def decode_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention (``module``'s ``num_key_value_groups`` query heads per key/value
    head), where on a CPU a one-token query without a mask runs its GQA as transformers runs it with a
    mask (``pack_gqa``: a key/value head's query heads as its query rows) instead of ``enable_gqa``."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] != 1 or attention_mask is not None or groups == 1 or kwargs.get("position_bias") is not None
            or not enabled(query.device)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, dim = query.shape
    out = F.scaled_dot_product_attention(query.reshape(batch, heads // groups, groups, dim), key, value,
                                         dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_decode_sdpa(model: torch.nn.Module) -> None:
    """Switch ``model`` (or a DDP wrapper's module) from transformers' ``sdpa`` attention to
    :func:`decode_sdpa` on a CPU: the same attention for every call but a one-token query without a
    mask (a vision-language model's sub-configs follow, as for the packed attention).

    The native engine switches the model it samples from when it is built, so a process's first
    rollout, which runs before the packed attention is installed (its unpacked forwards call
    :func:`decode_sdpa` too), computes as every later one: a resumed run repeats the straight one."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    param = next(iter(inner.parameters()), None)
    if param is None or not enabled(param.device) or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(DECODE_SDPA, decode_sdpa)
    AttentionMaskInterface.register(DECODE_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = DECODE_SDPA
