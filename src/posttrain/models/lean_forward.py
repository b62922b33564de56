"""The rollout's forward of a Llama-family model on a CPU, on fused prepacked weights.

A decode step multiplies a few rows by every weight of the model, so on a CPU much of it is the
fixed cost of each operator call and of Hugging Face's generic module code (decorators, keyword
plumbing, the attention and mask dispatch), not arithmetic: with one row, SmolLM2-135M's fp32 step
took 39-41 ms at 2 threads, of which the linear layers' weights take about 26. This forward runs
the same operators in the same order as transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` (RMSNorm in float32, rotary on the query/key heads, SDPA with the key/value heads shared by their
query groups), with changes that leave every number as it was:

* each layer's query/key/value projections are one product with the three weights stacked (and
  the MLP's gate and up projections one more), prepacked for oneDNN by
  :class:`~posttrain.models.packed_linear.PackedLinears` (``fuse``): 121 products a step instead of
  211 for SmolLM2's 30 layers; oneDNN computes every output column as it does unstacked, so the
  logits are bitwise those of the unfused packed layers (``tests/unit/rollout/test_lean_forward.py``);
* the layers are called directly (no hooks, no attention interface, the mask built once a call,
  as the additive float mask SDPA would otherwise build from a boolean one at every layer), from a
  :func:`plan` of each layer's packs, norms and head sizes made once a generate call: the output
  and down projections multiply with their packs directly (no module call), and no step looks up a
  submodule or an attribute (in a few-row step each such Python call costs several microseconds);
* fewer operators for the same arithmetic: a float32 RMSNorm as ``F.rms_norm`` (one operator for
  the module's eight, bitwise equal), the rotary embedding's ``rotate_half`` as a ``roll`` with the
  sign moved onto ``sin``.

Measured (SmolLM2-135M-Instruct, fp32, 2 threads, AMD EPYC with AVX512-BF16): a decode step of 1 row
41 -> 32 ms, 3 rows 40 -> 31 ms, 64 rows 162-176 -> 139-152 ms.

:func:`supported` admits a model whose ``config.model_type`` is ``llama``, ``qwen2`` or ``qwen3``
(its query/key head norms applied as one norm and one product) with every layer full attention, SiLU
MLPs, no other query/key norms and ``pretraining_tp`` 1; others keep the model's own forward. The
native engine uses this forward whenever it samples with packed weights (:mod:`posttrain.rollout.native`;
``$POSTTRAIN_LEAN_FORWARD=off`` turns it off).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.models.packed_linear import packed_linear

ENV = "POSTTRAIN_LEAN_FORWARD"
MODEL_TYPES = ("llama", "qwen2", "qwen3")


def enabled() -> bool:
    """Unless ``$POSTTRAIN_LEAN_FORWARD`` is ``off``."""
    return os.environ.get(ENV, "on").lower() != "off"


def supported(model) -> bool:
    """Whether ``model`` is a Llama-family causal LM this forward computes as transformers does."""
    config, inner = getattr(model, "config", None), getattr(model, "model", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES or not hasattr(inner, "layers"):
        return False
    if getattr(config, "pretraining_tp", 1) not in (None, 1) or getattr(config, "hidden_act", None) != "silu":
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return False
    if getattr(config, "use_sliding_window", False) or not hasattr(model, "lm_head"):
        return False
    need = ("q_proj", "k_proj", "v_proj", "o_proj")
    return all(all(isinstance(getattr(layer.self_attn, n, None), torch.nn.Linear) for n in need)
               and _head_norms_supported(layer.self_attn, config.model_type) and hasattr(layer.mlp, "gate_proj")
               for layer in inner.layers)


def _head_norms_supported(attn, model_type: str) -> bool:
    """No query/key norms, or Qwen3's: an RMSNorm of each head (one weight of ``head_dim``, one epsilon)."""
    norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
    if norms == [None, None]:
        return True
    return model_type == "qwen3" and all(
        isinstance(getattr(norm, "weight", None), torch.Tensor) and tuple(norm.weight.shape) == (attn.head_dim,)
        and getattr(norm, "variance_epsilon", None) == norms[0].variance_epsilon for norm in norms)


def fused_groups(model) -> list[tuple[torch.nn.Linear, ...]]:
    """The layers this forward multiplies with packs of its own: per decoder layer (q, k, v) and
    (gate, up) stacked, and o and down alone (called directly, not through their modules)."""
    return [group for layer in model.model.layers for group in _groups(layer)]


def _groups(layer) -> list[tuple[torch.nn.Linear, ...]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]


@dataclass(frozen=True)
class Layer:
    """One decoder layer as :func:`forward` runs it: its norms, its packs (``(pack, bias)``: stacked
    q/k/v, o, stacked gate/up, down), its cache index, the sizes of its heads and, for Qwen3, the
    norm of its query and key heads (:func:`_head_norm`)."""

    index: int
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    qkv: tuple
    o: tuple
    gate_up: tuple
    down: tuple
    q_heads: int
    kv_heads: int
    dim: int
    scaling: float
    head_norm: Callable[[torch.Tensor], torch.Tensor] | None = None


def plan(model, fused: dict) -> list[Layer] | None:
    """``model``'s layers with the packs of ``fused`` (:class:`~posttrain.models.packed_linear.PackedLinears`'
    ``fused`` for :func:`fused_groups`), looked up once a generate call rather than at every step (a
    decode step's operators are few-row products, where Python's attribute lookups and module calls
    count); None unless every group has its pack."""
    layers = []
    for index, layer in enumerate(model.model.layers):
        attn, groups = layer.self_attn, _groups(layer)
        if any(group not in fused for group in groups):
            return None
        layers.append(Layer(index, _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm),
                            *(fused[group] for group in groups), attn.q_proj.out_features // attn.head_dim,
                            attn.k_proj.out_features // attn.head_dim, attn.head_dim, attn.scaling,
                            _head_norm(attn)))
    return layers


def _attention_mask(mask: torch.Tensor, queries: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``mask [B, L]`` (1: a real column) as SDPA's additive ``[B, 1, Q, L]`` (0 where attended, -inf
    where not; SDPA turns a boolean mask into this same tensor, at every layer), causal for the
    last ``Q`` columns (the ones fed now); None for one query over all-real columns."""
    if queries == 1:
        if bool(mask.all()):
            return None
        keep = mask.bool()[:, None, None, :]
    else:
        length = mask.shape[1]
        causal = torch.ones(queries, length, dtype=torch.bool, device=mask.device).tril(length - queries)
        keep = causal[None, None] & mask.bool()[:, None, None, :]
    return torch.zeros(keep.shape, dtype=dtype, device=mask.device).masked_fill_(~keep, float("-inf"))


def _norm(norm: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's RMSNorm; on float32 as ``F.rms_norm`` (one operator, the same numbers as the
    module's eight; in bf16 the module's, which rounds its float32 result before the weight)."""
    if norm.weight.dtype != torch.float32:
        return norm
    shape, weight, eps = norm.weight.shape, norm.weight, norm.variance_epsilon
    return lambda hidden: F.rms_norm(hidden, shape, weight, eps) if hidden.dtype == torch.float32 else norm(hidden)


def _head_norm(attn) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Qwen3's RMSNorm of every query head (``q_norm``) and key head (``k_norm``) as one: ``[B, Q,
    heads, D]`` with the query heads first, normalised in float32, rounded to the input's dtype, then
    times the heads' weights stacked ``[heads, D]`` (the modules' numbers: two calls in one); None
    without such norms."""
    if getattr(attn, "q_norm", None) is None:
        return None
    q_heads, kv_heads = attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim
    norms = (attn.q_norm, q_heads), (attn.k_norm, kv_heads)
    weight = torch.cat([norm.weight.detach().expand(heads, -1) for norm, heads in norms])
    shape, eps = (attn.head_dim,), attn.q_norm.variance_epsilon
    return lambda heads: F.rms_norm(heads.float(), shape, None, eps).to(heads.dtype) * weight


def _rotary(cos: torch.Tensor, sin: torch.Tensor):
    """``x -> x * cos + rotate_half(x) * sin`` as ``x * cos + roll(x) * signed_sin`` (the halves
    swapped by one ``roll``, the sign of ``rotate_half``'s negated half moved onto ``sin``): the
    same numbers in three operators, not seven. ``cos``/``sin`` ``[B, 1, Q, D]``."""
    half = sin.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
    return lambda x: x * cos + x.roll(half, -1) * signed_sin


def forward(model, layers: list[Layer], ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
            keep: int) -> torch.Tensor:
    """Logits ``[B, keep, V]`` of the last ``keep`` fed positions, ``ids [B, Q]`` fed at ``positions
    [B, Q]`` after the cache's columns (``mask [B, L]`` over cache and fed columns); the fed keys and
    values are written into ``cache`` (its slab layers). ``layers``: :func:`plan`."""
    inner = model.model
    rows, queries = ids.shape
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    rotate = _rotary(cos[:, None], sin[:, None])  # [B, 1, Q, D]: broadcast over heads
    attn_mask = _attention_mask(mask, queries, hidden.dtype)
    cache_layers = cache.layers
    for layer in layers:
        dim, q_heads, kv_heads = layer.dim, layer.q_heads, layer.kv_heads
        qkv = packed_linear(layer.input_norm(hidden), *layer.qkv)
        qk, v = (part.view(rows, queries, -1, dim)
                 for part in qkv.split([(q_heads + kv_heads) * dim, kv_heads * dim], dim=-1))
        if layer.head_norm is not None:
            qk = layer.head_norm(qk)
        q, k = rotate(qk.transpose(1, 2)).split([q_heads, kv_heads], dim=1)  # query and key heads rotated together
        v = v.transpose(1, 2)
        k, v = cache_layers[layer.index].update(k, v)
        if queries == 1:  # a key/value head's query heads as its query rows (transformers' pack_gqa)
            out = F.scaled_dot_product_attention(q.reshape(rows, kv_heads, -1, dim), k, v, attn_mask=attn_mask,
                                                 scale=layer.scaling)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=layer.scaling,
                                                 enable_gqa=kv_heads != q_heads)
        hidden = hidden + packed_linear(out.reshape(rows, -1, queries, dim).transpose(1, 2).reshape(rows, queries, -1),
                                        *layer.o)
        gate, up = packed_linear(layer.post_norm(hidden), *layer.gate_up).chunk(2, -1)
        hidden = hidden + packed_linear(F.silu(gate) * up, *layer.down)
    return model.lm_head(_norm(inner.norm)(hidden[:, -keep:]))
