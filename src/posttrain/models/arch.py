"""Model architecture: the seed's model yaml keys <-> a Hugging Face ``config.json``.

The seed describes a model with Megatron keys (``num_layers``, ``hidden_size``,
``num_query_groups``...). Hugging Face describes it with its own names. :class:`ModelArch` is the
small common subset that posttrain needs: to build a random-init HF model, and to estimate memory
and FLOPs in ``posttrain plan`` without loading weights. No torch import here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from posttrain.errors import ConfigError
from posttrain.models.arch_keys import MLA, Router, deepseek_moe, dense_layers, mla, rope_scaling
from posttrain.models.vision_arch import KINDS, VisionTower, vision_from_hf_config, vision_tower


@dataclass(frozen=True)
class ModelArch:
    model_type: str  # HF model_type: qwen2, qwen3, qwen3_moe, llama, deepseek_v3
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 2
    norm_topk_prob: bool = False  # MoE: the top-k routing weights renormalised to sum to 1 (Qwen3-MoE)
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # HF rope_scaling items (rope_type llama3 or yarn); () none
    mla: MLA | None = None  # multi-latent attention (DeepSeek-V3); None: multi-head / grouped-query attention
    dense_layers: tuple[int, ...] = ()  # MoE: the layers (0-based) whose MLP is dense, not experts
    n_shared_experts: int = 0  # MoE: shared experts every token passes through (DeepSeek-V3)
    router: Router | None = None  # DeepSeek-V3's grouped sigmoid router; None: softmax top-k
    vision: VisionTower | None = None  # a vision-language model's vision tower (Qwen2.5-VL, Qwen3-VL); None: text only

    # ---- sizes -------------------------------------------------------------------------------
    def num_params(self) -> int:
        """Parameter count (all experts counted for MoE)."""
        h = self.hidden_size
        dense_mlp = 3 * h * self.ffn_hidden_size
        moe_layers = self.num_moe_layers()
        mlp = (self.num_layers - moe_layers) * dense_mlp + moe_layers * (self._moe_params_per_layer() + h *
                                                                          (self.num_experts or 0))
        layers = self.num_layers * (self._attention_params() + 2 * h) + mlp
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return layers + emb + h + (self.vision.num_params() if self.vision is not None else 0)

    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            return self.mla.params(h, self.num_attention_heads)
        kv, q = self.num_kv_heads * self.head_dim, self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        return attn + (2 * self.head_dim if self.qk_norm else 0)

    def num_moe_layers(self) -> int:
        """Layers whose MLP is the experts (0 for a dense model)."""
        return self.num_layers - len(self.dense_layers) if self.num_experts else 0

    def _moe_params_per_layer(self) -> int:
        """The routed and shared experts of one MoE layer (not the router)."""
        width = self.moe_ffn_hidden_size or self.ffn_hidden_size
        return 3 * self.hidden_size * width * ((self.num_experts or 0) + self.n_shared_experts)

    def expert_params(self) -> int:
        """Parameters of the routed experts of every layer (0 for a dense model): what expert parallelism splits."""
        if not self.num_experts:
            return 0
        width = self.moe_ffn_hidden_size or self.ffn_hidden_size
        return self.num_moe_layers() * 3 * self.hidden_size * width * self.num_experts

    def kv_cache_bytes_per_token(self, bytes_per_value: int) -> int:
        if self.mla is not None:
            return self.num_layers * self.mla.kv_values_per_layer(self.num_attention_heads) * bytes_per_value
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    # ---- conversions -------------------------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [_ARCHITECTURES[self.model_type]],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
        }
        if self.model_type == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        if self.vision is not None:
            return self._vlm_config(cfg)
        if self.mla is not None:
            cfg.update(self._deepseek_v3_config())
        elif self.num_experts:  # Qwen3-MoE: the experts in every layer but the dense ones, no shared expert
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.moe_router_topk,
                       moe_intermediate_size=self.moe_ffn_hidden_size or self.ffn_hidden_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                       mlp_only_layers=list(self.dense_layers), output_router_logits=False)
        return cfg

    def _vlm_config(self, text: dict[str, Any]) -> dict[str, Any]:
        """A VLM's nested config (Qwen2.5-VL, Qwen3-VL): the language model's keys (with its 3-D rotary split) in
        ``text_config``, the tower's in ``vision_config``; the vision token ids are the tokenizer's."""
        assert self.vision is not None
        text = {k: v for k, v in text.items() if k not in ("model_type", "architectures", "tie_word_embeddings")}
        kind = KINDS[self.model_type]
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                                   "mrope_section": kind.mrope(self.head_dim),
                                   **({"mrope_interleaved": True} if kind.mrope_interleaved else {})}
        return {"model_type": self.model_type, "architectures": [_ARCHITECTURES[self.model_type]],
                "tie_word_embeddings": self.tie_embeddings, "text_config": text,
                "vision_config": self.vision.to_hf_config()}

    def _deepseek_v3_config(self) -> dict[str, Any]:
        """DeepSeek-V3's keys: MLA sizes, the experts (dense layers first), the grouped router."""
        assert self.mla is not None and self.router is not None and self.num_experts
        dense = len(self.dense_layers)
        assert self.dense_layers == tuple(range(dense)), "DeepSeek-V3's dense layers are the first ones"
        return {"q_lora_rank": self.mla.q_lora_rank, "kv_lora_rank": self.mla.kv_lora_rank,
                "qk_nope_head_dim": self.mla.qk_nope_head_dim, "qk_rope_head_dim": self.mla.qk_rope_head_dim,
                "v_head_dim": self.mla.v_head_dim, "head_dim": self.mla.qk_rope_head_dim,
                "n_routed_experts": self.num_experts, "n_shared_experts": self.n_shared_experts,
                "moe_intermediate_size": self.moe_ffn_hidden_size or self.ffn_hidden_size,
                "num_experts_per_tok": self.moe_router_topk, "first_k_dense_replace": dense,
                "n_group": self.router.num_groups, "topk_group": self.router.group_topk,
                "routed_scaling_factor": self.router.scaling_factor, "norm_topk_prob": self.norm_topk_prob,
                "attention_bias": False, "num_nextn_predict_layers": 0}


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "llama": "LlamaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  **{model_type: kind.hf_class for model_type, kind in KINDS.items()}}


def arch_from_model_yaml(name: str, keys: Mapping[str, Any], vocab_size: int | None = None) -> ModelArch:
    """Build a :class:`ModelArch` from the seed's model-yaml keys (Megatron names)."""
    try:
        heads = int(keys["num_attention_heads"])
        hidden = int(keys["hidden_size"])
        layers = int(keys["num_layers"])
    except KeyError as err:
        raise ConfigError(f"model '{name}': key {err.args[0]} is required to size the model") from None
    kv_heads = int(keys.get("num_query_groups") or heads) if keys.get("group_query_attention") else heads
    deepseek = bool(keys.get("multi_latent_attention"))
    model_type = "deepseek_v3" if deepseek else keys.get("hf_model_type") or (
        ("qwen3_moe" if keys.get("num_experts") else "qwen3") if keys.get("qk_layernorm")
        else "qwen2" if keys.get("add_qkv_bias") else "llama")
    if deepseek and keys.get("hf_model_type") not in (None, "deepseek_v3"):
        raise ConfigError(f"model '{name}': hf_model_type={keys['hf_model_type']} with multi_latent_attention: MLA "
                          f"is built in the DeepSeek-V3 model; remove hf_model_type or set it to deepseek_v3")
    if model_type == "deepseek_v3" and not deepseek:
        raise ConfigError(f"model '{name}': hf_model_type=deepseek_v3 needs multi_latent_attention: true (and its "
                          f"sizes)")
    if deepseek:
        _check_mla_attention(name, keys)
        kv_heads = heads
    head_dim = int(keys.get("kv_channels") or hidden // heads)
    shared, router = deepseek_moe(name, keys, deepseek)
    vocab = vocab_size or keys.get("padded_vocab_size")
    if not vocab:
        raise ConfigError(f"model '{name}': padded_vocab_size is needed to size the model")
    return ModelArch(
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=int(keys.get("ffn_hidden_size") or 4 * hidden),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(vocab),
        tie_embeddings=not keys.get("untie_embeddings_and_output_weights", False),
        qkv_bias=bool(keys.get("add_qkv_bias", False)),
        qk_norm=bool(keys.get("qk_layernorm", False)) and not deepseek,  # MLA: the latent norms (MLA.params)
        rope_theta=float(keys.get("rotary_base") or 10000.0),
        norm_eps=float(keys.get("norm_epsilon") or 1e-6),
        max_position_embeddings=int(keys.get("max_position_embeddings") or 4096),
        num_experts=keys.get("num_experts"),
        moe_ffn_hidden_size=keys.get("moe_ffn_hidden_size"),
        moe_router_topk=int(keys.get("moe_router_topk") or 2),
        norm_topk_prob=bool(keys.get("norm_topk_prob", False)),
        rope_scaling=rope_scaling(name, keys),
        mla=mla(name, keys, head_dim),
        dense_layers=dense_layers(name, keys, layers, deepseek),
        n_shared_experts=shared,
        router=router,
        vision=vision_tower(name, keys, model_type, hidden),
    )


def _check_mla_attention(name: str, keys: Mapping[str, Any]) -> None:
    """What DeepSeek-V3's attention (MLA) is: every head its own keys and values from the latent, no
    bias, the latents normalised (Megatron's ``qk_layernorm`` under MLA)."""
    for key, wrong, what in (("group_query_attention", True, "every head reads its own keys and values from the "
                                                                "latent"),
                             ("add_qkv_bias", True, "its projections have no bias"),
                             ("qk_layernorm", False, "it normalises the query and key-value latents")):
        if bool(keys.get(key, False)) == wrong:
            raise ConfigError(f"model '{name}': {key}={wrong} with multi_latent_attention: DeepSeek-V3's attention "
                              f"(MLA) {what}; set {key}: {str(not wrong).lower()}")


_HF_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")


def arch_from_hf_config(path: str | Path) -> ModelArch:
    """Read an HF ``config.json`` (or a model directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such HF config.json")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: an HF config.json is a JSON object, not {type(cfg).__name__}")
    vision = None
    if isinstance(cfg.get("text_config"), dict) and isinstance(cfg.get("vision_config"), dict):  # a VLM
        vision = vision_from_hf_config(cfg["vision_config"], str(cfg.get("model_type")))
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **cfg["text_config"],
               "model_type": cfg.get("model_type")}
    for key in _HF_REQUIRED:
        value = cfg.get(key)
        if key not in cfg:
            raise ConfigError(f"{path}: missing key {key!r}; an HF model config.json needs "
                              f"{', '.join(_HF_REQUIRED)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{path}: {key} must be a positive integer, found {value!r}")
    heads = cfg["num_attention_heads"]
    return ModelArch(
        model_type=cfg.get("model_type", "llama"),
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
        num_attention_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=cfg.get("model_type") in ("qwen2", "qwen2_5_vl") or (bool(cfg.get("attention_bias", False))
                                                       and cfg.get("model_type") != "deepseek_v3"),
        qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe", "qwen3_vl"),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"),
        moe_ffn_hidden_size=cfg.get("moe_intermediate_size"),
        moe_router_topk=int(cfg.get("num_experts_per_tok") or 2),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        vision=vision,
        **_hf_extras(cfg),
    )


def _hf_extras(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE scaling, and DeepSeek-V3's MLA, dense layers, shared experts and router, of an HF config."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"  # "type": the older transformers' name
    rope = {k: v for k, v in rope.items() if k != "rope_theta"} if kind not in ("default", "mrope") else {}
    layers = int(cfg["num_hidden_layers"])
    extras: dict[str, Any] = {"rope_scaling": tuple(rope.items()),
                              "dense_layers": tuple(sorted(int(i) for i in cfg.get("mlp_only_layers") or ()))}
    if cfg.get("model_type") == "deepseek_v3":
        extras.update(
            mla=MLA(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(cfg["kv_lora_rank"]),
                    qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                    v_head_dim=int(cfg["v_head_dim"])),
            dense_layers=tuple(range(min(int(cfg.get("first_k_dense_replace") or 0), layers))),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            router=Router(num_groups=int(cfg.get("n_group") or 1), group_topk=int(cfg.get("topk_group") or 1),
                          scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0)))
    return extras


# the architectures the Hugging Face <-> Megatron-Core mapping (posttrain.models.mcore) covers
MCORE_DENSE = ("qwen2", "qwen3", "llama")
MCORE_MOE = ("qwen3_moe",)
MCORE_VLM = ("qwen2_5_vl",)  # vision-language models whose language model is mapped (training/megatron/vision.py)


def mcore_gap(arch: ModelArch) -> tuple[str, str] | None:
    """What of ``arch`` the Hugging Face <-> Megatron-Core mapping (the megatron backend, ``posttrain
    convert``) does not cover: (the model-yaml key that asks for it, why), or None."""
    if arch.mla is not None or arch.model_type == "deepseek_v3":
        return "multi_latent_attention", "multi-latent attention (DeepSeek-V3) is not mapped to Megatron-Core"
    if arch.num_experts and arch.model_type not in MCORE_MOE:
        return "num_experts", (f"of the mixture-of-experts models the mapping covers {', '.join(MCORE_MOE)} "
                               f"(Qwen3-MoE) only, not {arch.model_type}")
    if not arch.num_experts and arch.model_type not in MCORE_DENSE + MCORE_VLM:
        return "hf_model_type", (f"model_type {arch.model_type} is not mapped to Megatron-Core (the mapping covers "
                                 f"{', '.join(MCORE_DENSE + MCORE_MOE)}, and the language model of "
                                 f"{', '.join(MCORE_VLM)} with rl_config.is_multimodal: true)")
    if arch.dense_layers:
        return "first_k_dense_replace", "the mapping covers mixture-of-experts models with experts in every layer"
    if arch.rope_scaling:
        return "rope_scaling_type", "RoPE scaling is not passed to Megatron-Core's model"
    return None
