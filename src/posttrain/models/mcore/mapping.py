"""Parameter names and layouts: Hugging Face (Qwen2/2.5, Qwen3, Llama/SmolLM2) <-> Megatron-Core GPTModel.

One table, :func:`layer_params`, says for every parameter of a transformer layer its Megatron-Core
name (local layer spec, as MindSpeed-LLM writes it), its HF name(s), and how tensor parallelism
splits it. The converter uses it one layer at a time; the Megatron-Core training backend uses the
same table.

Megatron-Core names (``decoder.layers.{i}.`` prefix, ``i`` local to the pipeline stage)::

    input_layernorm.weight                          <- model.layers.{i}.input_layernorm.weight
    self_attention.linear_qkv.weight / .bias        <- self_attn.{q,k,v}_proj.weight / .bias
    self_attention.q_layernorm.weight (Qwen3)       <- self_attn.q_norm.weight
    self_attention.k_layernorm.weight (Qwen3)       <- self_attn.k_norm.weight
    self_attention.linear_proj.weight               <- self_attn.o_proj.weight
    pre_mlp_layernorm.weight                        <- post_attention_layernorm.weight
    mlp.linear_fc1.weight                           <- mlp.{gate,up}_proj.weight
    mlp.linear_fc2.weight                           <- mlp.down_proj.weight

and for a mixture-of-experts (Qwen3-MoE) layer, instead of the last two (``e``: the expert's index
local to its expert-parallel rank in Megatron-Core, global in HF)::

    mlp.router.weight                               <- mlp.gate.weight
    mlp.experts.local_experts.{e}.linear_fc1.weight <- mlp.experts.{e}.{gate,up}_proj.weight
    mlp.experts.local_experts.{e}.linear_fc2.weight <- mlp.experts.{e}.down_proj.weight

and outside the layers: ``embedding.word_embeddings.weight`` (first stage), ``decoder.final_layernorm
.weight`` and ``output_layer.weight`` (last stage; a tied model has an output layer only when it has
more than one stage), or ``rm_head.weight`` for a reward model (``--orm``; HF ``score.weight``, a
row-parallel linear hidden -> 1, as Megatron reward heads are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.models.arch import ModelArch
from posttrain.models.mcore import splits

# kinds: how tensor parallelism splits a parameter
QKV, FC1, COLUMN, ROW, REPLICATED, VOCAB = "qkv", "fc1", "column", "row", "replicated", "vocab"

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"
RM_HEAD = "rm_head.weight"
HF_EMBEDDING, HF_FINAL_NORM, HF_LM_HEAD, HF_SCORE = "model.embed_tokens.weight", "model.norm.weight", \
    "lm_head.weight", "score.weight"


@dataclass(frozen=True)
class Param:
    mcore: str              # name under decoder.layers.{i}.
    hf: tuple[str, ...]     # names under model.layers.{i}.
    kind: str
    expert: bool = False    # one per expert: ``{e}`` in the names (see :func:`for_expert`)

    def for_expert(self, local: int, index: int) -> "Param":
        """This expert parameter for the expert ``index`` (global), ``local`` on its rank."""
        return Param(self.mcore.format(e=local), tuple(n.format(e=index) for n in self.hf), self.kind)


def layer_params(arch: ModelArch) -> list[Param]:
    """Every parameter of one transformer layer of ``arch``."""
    attn = "self_attn."
    params = [Param("input_layernorm.weight", ("input_layernorm.weight",), REPLICATED),
              Param("self_attention.linear_qkv.weight", tuple(f"{attn}{p}_proj.weight" for p in "qkv"), QKV)]
    if arch.qkv_bias:
        params.append(Param("self_attention.linear_qkv.bias", tuple(f"{attn}{p}_proj.bias" for p in "qkv"), QKV))
    if arch.qk_norm:
        params += [Param("self_attention.q_layernorm.weight", (f"{attn}q_norm.weight",), REPLICATED),
                   Param("self_attention.k_layernorm.weight", (f"{attn}k_norm.weight",), REPLICATED)]
    params += [Param("self_attention.linear_proj.weight", (f"{attn}o_proj.weight",), ROW),
               Param("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), REPLICATED)]
    if arch.num_experts:
        experts = "mlp.experts.local_experts.{e}."
        return params + [
            Param("mlp.router.weight", ("mlp.gate.weight",), REPLICATED),
            Param(experts + "linear_fc1.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                  FC1, expert=True),
            Param(experts + "linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",), ROW, expert=True)]
    return params + [Param("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), FC1),
                     Param("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ROW)]


def rank_params(params: list[Param], arch: ModelArch, ep: int = 1, ep_rank: int = 0) -> list[Param]:
    """``params`` (:func:`layer_params`) as expert-parallel rank ``ep_rank`` of ``ep`` holds them: each
    expert parameter once per local expert (the experts split in ``ep`` equal consecutive blocks)."""
    local = (arch.num_experts or 0) // ep
    return [q for p in params
            for q in ([p.for_expert(e, ep_rank * local + e) for e in range(local)] if p.expert else [p])]


def hf_layer_name(layer: int, name: str) -> str:
    return f"model.layers.{layer}.{name}"


def mcore_layer_name(local_layer: int, name: str) -> str:
    return f"decoder.layers.{local_layer}.{name}"


def split_param(param: Param, tensors: list[torch.Tensor], arch: ModelArch, tp: int) -> list[torch.Tensor]:
    """The HF tensor(s) of ``param`` -> its ``tp`` Megatron-Core shards."""
    if param.kind == QKV:
        return splits.split_qkv(*tensors, groups=arch.num_kv_heads, tp=tp)
    if param.kind == FC1:
        return splits.split_gated_fc1(*tensors, tp=tp)
    if param.kind == REPLICATED:
        return [tensors[0].clone() for _ in range(tp)]
    return splits.split_dim(tensors[0], tp, 0 if param.kind == COLUMN else 1)


def merge_param(param: Param, shards: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    """The ``tp`` Megatron-Core shards of ``param`` -> its HF tensor(s), in ``param.hf`` order."""
    if param.kind == QKV:
        return list(splits.merge_qkv(shards, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim))
    if param.kind == FC1:
        return list(splits.merge_gated_fc1(shards))
    if param.kind == REPLICATED:
        return [shards[0].contiguous()]
    return [splits.merge_dim(shards, 0 if param.kind == COLUMN else 1)]
