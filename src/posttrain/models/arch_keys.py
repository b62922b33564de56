"""The seed's advanced architecture keys of a model yaml, read into what a Hugging Face model builds.

:func:`posttrain.models.arch.arch_from_model_yaml` reads the plain sizes; this module reads the rest:

* RoPE scaling (``rope_scaling_type`` llama3 or yarn and its factors) -> the HF ``rope_scaling``
  (``rope_parameters``) of the model built;
* multi-latent attention (``multi_latent_attention`` and ``q_lora_rank``, ``kv_lora_rank``,
  ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim``) -> a DeepSeek-V3 model (HF ``deepseek_v3``);
* the mixture-of-experts layout (``first_k_dense_replace``, ``moe_layer_freq``) -> the layers whose MLP
  is dense; and DeepSeek's experts and router (``n_shared_experts``, ``moe_router_score_function``,
  ``moe_router_enable_expert_bias``, ``moe_router_num_groups``, ``moe_router_group_topk``,
  ``moe_router_topk_scaling_factor``), which only the DeepSeek-V3 model has.

A value the model built cannot carry is refused naming the key and saying what to do: nothing is
read and then dropped. No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from posttrain.errors import ConfigError

MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
DEEPSEEK_MOE_KEYS = ("n_shared_experts", "moe_router_num_groups", "moe_router_group_topk",
                     "moe_router_topk_scaling_factor")
# the yarn keys and their defaults (MegatronConfig's): another value without rope_scaling_type yarn is refused
YARN_DEFAULTS = {"beta_fast": 32, "beta_slow": 1, "rope_scaling_mscale": 1.0, "rope_scaling_mscale_all_dim": 0.0,
                 "rope_scaling_original_max_position_embeddings": None}
LLAMA3_DEFAULTS = {"low_freq_factor": None, "high_freq_factor": None, "original_max_position_embeddings": None}


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention sizes (DeepSeek-V2/V3): queries through a rank-``q_lora_rank`` bottleneck
    (None: a full projection), keys and values through a rank-``kv_lora_rank`` latent; each head's query
    and key are ``qk_nope_head_dim`` features without RoPE plus ``qk_rope_head_dim`` with it."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def params(self, hidden: int, heads: int) -> int:
        """Parameters of one attention block (projections and the two latent norms; no bias)."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = hidden * heads * qk
        else:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        kv = (hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + heads * self.v_head_dim * hidden

    def kv_values_per_layer(self, heads: int) -> int:
        """Values a token keeps in the KV cache per layer (the HF model caches the expanded keys and values)."""
        return heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class Router:
    """DeepSeek-V3's router: sigmoid scores with an expert bias, top-k within the best groups, scaled."""

    num_groups: int = 1
    group_topk: int = 1
    scaling_factor: float = 1.0


def _key(name: str, key: str, value: Any) -> str:
    return f"model '{name}': {key}={value!r}"


def rope_scaling(name: str, keys: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The HF ``rope_scaling`` items of ``rope_scaling_type`` (empty: no scaling)."""
    kind = keys.get("rope_scaling_type")
    factor = float(keys.get("rope_scaling_factor") or 1.0)
    if kind is None:
        if factor != 1.0:
            raise ConfigError(f"{_key(name, 'rope_scaling_factor', factor)} without rope_scaling_type: set "
                              f"rope_scaling_type (llama3 or yarn) or remove the key")
        _refuse_set(name, keys, {**YARN_DEFAULTS, **LLAMA3_DEFAULTS}, "rope_scaling_type")
        return ()
    if kind == "llama3":
        _refuse_set(name, keys, YARN_DEFAULTS, "rope_scaling_type: yarn")
        missing = [k for k in LLAMA3_DEFAULTS if keys.get(k) is None]
        if missing:
            raise ConfigError(f"{_key(name, 'rope_scaling_type', kind)} needs {', '.join(missing)} (the llama3 "
                              f"scaling's frequency bands and the pre-training context); set them")
        return (("rope_type", "llama3"), ("factor", factor), ("low_freq_factor", float(keys["low_freq_factor"])),
                ("high_freq_factor", float(keys["high_freq_factor"])),
                ("original_max_position_embeddings", int(keys["original_max_position_embeddings"])))
    if kind == "yarn":
        _refuse_set(name, keys, LLAMA3_DEFAULTS, "rope_scaling_type: llama3")
        original = keys.get("rope_scaling_original_max_position_embeddings")
        if original is None:
            raise ConfigError(f"{_key(name, 'rope_scaling_type', kind)} needs "
                              f"rope_scaling_original_max_position_embeddings (the pre-training context); set it")
        return (("rope_type", "yarn"), ("factor", factor), ("beta_fast", float(keys.get("beta_fast", 32))),
                ("beta_slow", float(keys.get("beta_slow", 1))),
                ("mscale", float(keys.get("rope_scaling_mscale", 1.0))),
                ("mscale_all_dim", float(keys.get("rope_scaling_mscale_all_dim", 0.0))),
                ("original_max_position_embeddings", int(original)))
    raise ConfigError(f"{_key(name, 'rope_scaling_type', kind)}: posttrain builds llama3 and yarn RoPE scaling; "
                      f"set one of them or remove the key")


def _refuse_set(name: str, keys: Mapping[str, Any], defaults: Mapping[str, Any], needs: str) -> None:
    for key, default in defaults.items():
        value = keys.get(key, default)
        if value is not None and value != default:
            raise ConfigError(f"{_key(name, key, value)}: only read with {needs}; remove the key or set "
                              f"{needs}")


def mla(name: str, keys: Mapping[str, Any], head_dim: int) -> MLA | None:
    """The multi-latent attention sizes, or None (then the MLA size keys must be unset)."""
    if not keys.get("multi_latent_attention"):
        for key in MLA_KEYS:
            if keys.get(key) is not None:
                raise ConfigError(f"{_key(name, key, keys[key])}: an MLA size, read only with "
                                  f"multi_latent_attention: true; remove the key or turn MLA on")
        return None
    if keys.get("kv_lora_rank") is None:
        raise ConfigError(f"model '{name}': multi_latent_attention needs kv_lora_rank (the key-value latent's "
                          f"rank); set it")
    sizes = {k: keys.get(k) for k in MLA_KEYS}
    for key, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{_key(name, key, value)}: must be a whole number >= 1")
    return MLA(q_lora_rank=sizes["q_lora_rank"], kv_lora_rank=sizes["kv_lora_rank"],
               qk_nope_head_dim=sizes["qk_head_dim"] or head_dim,
               qk_rope_head_dim=sizes["qk_pos_emb_head_dim"] or 64, v_head_dim=sizes["v_head_dim"] or head_dim)


def dense_layers(name: str, keys: Mapping[str, Any], num_layers: int, deepseek: bool) -> tuple[int, ...]:
    """The layers (0-based) of a mixture-of-experts model whose MLP is dense: the first
    ``first_k_dense_replace``, and those ``moe_layer_freq`` skips (layer i has experts when
    ``i % moe_layer_freq == 0``, Megatron's rule)."""
    first_k = keys.get("first_k_dense_replace")
    freq = keys.get("moe_layer_freq")
    if not keys.get("num_experts"):
        for key, value in (("first_k_dense_replace", first_k), ("moe_layer_freq", freq)):
            if value is not None:
                raise ConfigError(f"{_key(name, key, value)}: a mixture-of-experts layout, and the model has no "
                                  f"experts (num_experts); remove the key or set num_experts")
        return ()
    first_k, freq = int(first_k or 0), int(freq or 1)
    if not 0 <= first_k < num_layers:
        raise ConfigError(f"{_key(name, 'first_k_dense_replace', first_k)}: must be in [0, num_layers={num_layers})")
    if freq < 1:
        raise ConfigError(f"{_key(name, 'moe_layer_freq', freq)}: must be a whole number >= 1")
    if deepseek and freq != 1:
        raise ConfigError(f"{_key(name, 'moe_layer_freq', freq)}: the DeepSeek-V3 model (multi_latent_attention) "
                          f"has experts in every layer after the first first_k_dense_replace; set it to 1")
    return tuple(i for i in range(num_layers) if i < first_k or i % freq)


def deepseek_moe(name: str, keys: Mapping[str, Any], deepseek: bool) -> tuple[int, Router | None]:
    """The shared experts and the router: DeepSeek-V3's (sigmoid scores, expert bias, groups,
    scaling), which only the DeepSeek-V3 model builds; a softmax router without them elsewhere."""
    sigmoid = keys.get("moe_router_score_function", "softmax") == "sigmoid"
    bias = bool(keys.get("moe_router_enable_expert_bias", False))
    if keys.get("moe_router_score_function", "softmax") not in ("softmax", "sigmoid"):
        raise ConfigError(f"{_key(name, 'moe_router_score_function', keys['moe_router_score_function'])}: "
                          f"use softmax (Qwen3-MoE) or sigmoid (DeepSeek-V3)")
    if not deepseek:
        for key, value, default in (("moe_router_score_function", "sigmoid" if sigmoid else "softmax", "softmax"),
                                    ("moe_router_enable_expert_bias", bias, False),
                                    *((k, keys.get(k), None) for k in DEEPSEEK_MOE_KEYS)):
            if value != default and not (key == "n_shared_experts" and value == 0):
                raise ConfigError(f"{_key(name, key, value)}: DeepSeek-V3's shared experts and router are built only "
                                  f"in the DeepSeek-V3 model (multi_latent_attention: true); the other models route "
                                  f"with softmax scores. Remove the key, or describe a DeepSeek-V3 model")
        return 0, None
    if not keys.get("num_experts"):
        raise ConfigError(f"model '{name}': multi_latent_attention builds DeepSeek-V3, a mixture-of-experts "
                          f"model; set num_experts (and n_shared_experts, the router keys)")
    if not (sigmoid and bias):
        raise ConfigError(f"model '{name}': moe_router_score_function={'sigmoid' if sigmoid else 'softmax'}, "
                          f"moe_router_enable_expert_bias={bias}: DeepSeek-V3's router (multi_latent_attention) "
                          f"scores with sigmoid and an expert bias; set moe_router_score_function: sigmoid and "
                          f"moe_router_enable_expert_bias: true")
    shared = keys.get("n_shared_experts")
    if not shared:
        raise ConfigError(f"{_key(name, 'n_shared_experts', shared)}: DeepSeek-V3 (multi_latent_attention) has "
                          f"shared experts; set n_shared_experts >= 1")
    router = Router(num_groups=int(keys.get("moe_router_num_groups") or 1),
                    group_topk=int(keys.get("moe_router_group_topk") or 1),
                    scaling_factor=float(keys.get("moe_router_topk_scaling_factor") or 1.0))
    experts, topk = int(keys["num_experts"]), int(keys.get("moe_router_topk") or 2)
    if experts % router.num_groups or router.group_topk > router.num_groups:
        raise ConfigError(f"model '{name}': moe_router_num_groups={router.num_groups} must divide num_experts="
                          f"{experts}, and moe_router_group_topk={router.group_topk} be at most it")
    if topk > router.group_topk * experts // router.num_groups:
        raise ConfigError(f"model '{name}': moe_router_topk={topk} is more experts than moe_router_group_topk="
                          f"{router.group_topk} groups of {experts // router.num_groups} hold; lower it or raise "
                          f"moe_router_group_topk")
    return int(shared), router
