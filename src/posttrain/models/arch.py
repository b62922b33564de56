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


@dataclass(frozen=True)
class ModelArch:
    model_type: str  # HF model_type: qwen2, qwen3, qwen3_moe, llama
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

    # ---- sizes -------------------------------------------------------------------------------
    def num_params(self) -> int:
        """Parameter count (all experts counted for MoE)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * h * self._ffn_per_token_width(all_experts=True)
        if self.num_experts:
            mlp += h * self.num_experts  # router
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + emb + h

    def expert_params(self) -> int:
        """Parameters of the experts of every layer (0 for a dense model): what expert parallelism splits."""
        return self.num_layers * 3 * self.hidden_size * self._ffn_per_token_width(all_experts=True) \
            if self.num_experts else 0

    def _ffn_per_token_width(self, all_experts: bool) -> int:
        if not self.num_experts:
            return self.ffn_hidden_size
        width = self.moe_ffn_hidden_size or self.ffn_hidden_size
        return width * (self.num_experts if all_experts else self.moe_router_topk)

    def kv_cache_bytes_per_token(self, bytes_per_value: int) -> int:
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
        if self.num_experts:  # Qwen3-MoE: every layer's MLP is the experts, no shared expert
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.moe_router_topk,
                       moe_intermediate_size=self.moe_ffn_hidden_size or self.ffn_hidden_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                       output_router_logits=False)
        return cfg


_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "llama": "LlamaForCausalLM"}


def arch_from_model_yaml(name: str, keys: Mapping[str, Any], vocab_size: int | None = None) -> ModelArch:
    """Build a :class:`ModelArch` from the seed's model-yaml keys (Megatron names)."""
    try:
        heads = int(keys["num_attention_heads"])
        hidden = int(keys["hidden_size"])
        layers = int(keys["num_layers"])
    except KeyError as err:
        raise ConfigError(f"model '{name}': key {err.args[0]} is required to size the model") from None
    kv_heads = int(keys.get("num_query_groups") or heads) if keys.get("group_query_attention") else heads
    model_type = keys.get("hf_model_type") or (
        ("qwen3_moe" if keys.get("num_experts") else "qwen3") if keys.get("qk_layernorm")
        else "qwen2" if keys.get("add_qkv_bias") else "llama")
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
        head_dim=int(keys.get("kv_channels") or hidden // heads),
        vocab_size=int(vocab),
        tie_embeddings=not keys.get("untie_embeddings_and_output_weights", False),
        qkv_bias=bool(keys.get("add_qkv_bias", False)),
        qk_norm=bool(keys.get("qk_layernorm", False)),
        rope_theta=float(keys.get("rotary_base") or 10000.0),
        norm_eps=float(keys.get("norm_epsilon") or 1e-6),
        max_position_embeddings=int(keys.get("max_position_embeddings") or 4096),
        num_experts=keys.get("num_experts"),
        moe_ffn_hidden_size=keys.get("moe_ffn_hidden_size"),
        moe_router_topk=int(keys.get("moe_router_topk") or 2),
        norm_topk_prob=bool(keys.get("norm_topk_prob", False)),
    )


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
        qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe"),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"),
        moe_ffn_hidden_size=cfg.get("moe_intermediate_size"),
        moe_router_topk=int(cfg.get("num_experts_per_tok") or 2),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
