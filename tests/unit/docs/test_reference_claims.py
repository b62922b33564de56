"""No silent architecture key: every key that docs/config_reference.md marks honoured because it
describes the model (``posttrain.config.megatron.ARCH``) changes what ``posttrain init-model`` builds
and what ``posttrain plan`` sizes.

Each such key has an observer below (a base model yaml and a change of the key); the model built
from the changed keys (:func:`posttrain.models.arch.arch_from_model_yaml`: its Hugging Face config,
parameter count and KV-cache size) must differ from the base's. A new architecture key without an
observer fails :func:`test_every_architecture_key_has_an_observer`."""

from __future__ import annotations

import pytest

from posttrain.config.fields import ARCH_WHY, Status, field_rule
from posttrain.config.megatron import MegatronConfig
from posttrain.config.reference import render_reference
from posttrain.models.arch import arch_from_model_yaml

DENSE = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
         "group_query_attention": True, "num_query_groups": 2, "add_qkv_bias": True, "padded_vocab_size": 256}
LLAMA3 = {**DENSE, "rope_scaling_type": "llama3", "rope_scaling_factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {**DENSE, "rope_scaling_type": "yarn", "rope_scaling_factor": 4.0,
        "rope_scaling_original_max_position_embeddings": 64}
MOE = {**DENSE, "num_layers": 4, "add_qkv_bias": False, "qk_layernorm": True, "num_experts": 4,
       "moe_ffn_hidden_size": 32, "moe_router_topk": 2}
DEEPSEEK = {"num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
            "padded_vocab_size": 256, "untie_embeddings_and_output_weights": True, "multi_latent_attention": True,
            "qk_layernorm": True, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 8,
            "v_head_dim": 12, "num_experts": 8, "moe_ffn_hidden_size": 32, "moe_router_topk": 2,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
            "moe_router_topk_scaling_factor": 2.5, "norm_topk_prob": True}
PLAIN_MOE = {k: v for k, v in MOE.items() if k != "qk_layernorm"}  # a llama-type MoE: hf_model_type picks qwen3_moe

# key -> (the base model yaml keys, the change); the model built must differ
OBSERVERS = {
    "hf_model_type": (PLAIN_MOE | {"num_experts": None}, {"hf_model_type": "qwen3"}),
    "num_layers": (DENSE, {"num_layers": 3}),
    "hidden_size": (DENSE, {"hidden_size": 128}),
    "ffn_hidden_size": (DENSE, {"ffn_hidden_size": 64}),
    "num_attention_heads": (DENSE, {"num_attention_heads": 8}),
    "kv_channels": (DENSE, {"kv_channels": 32}),
    "group_query_attention": (DENSE, {"group_query_attention": False}),
    "num_query_groups": (DENSE, {"num_query_groups": 1}),
    "untie_embeddings_and_output_weights": (DENSE, {"untie_embeddings_and_output_weights": True}),
    "add_qkv_bias": (DENSE, {"add_qkv_bias": False}),
    "qk_layernorm": (DENSE, {"qk_layernorm": True}),
    "rotary_base": (DENSE, {"rotary_base": 1e6}),
    "max_position_embeddings": (DENSE, {"max_position_embeddings": 8192}),
    "rope_scaling_type": (DENSE, {"rope_scaling_type": "yarn", "rope_scaling_original_max_position_embeddings": 64}),
    "rope_scaling_factor": (YARN, {"rope_scaling_factor": 8.0}),
    "low_freq_factor": (LLAMA3, {"low_freq_factor": 2.0}),
    "high_freq_factor": (LLAMA3, {"high_freq_factor": 8.0}),
    "original_max_position_embeddings": (LLAMA3, {"original_max_position_embeddings": 128}),
    "beta_fast": (YARN, {"beta_fast": 16}),
    "beta_slow": (YARN, {"beta_slow": 2}),
    "rope_scaling_mscale": (YARN, {"rope_scaling_mscale": 0.7}),
    "rope_scaling_mscale_all_dim": (YARN, {"rope_scaling_mscale_all_dim": 1.0}),
    "rope_scaling_original_max_position_embeddings": (YARN, {"rope_scaling_original_max_position_embeddings": 128}),
    "norm_epsilon": (DENSE, {"norm_epsilon": 1e-5}),
    "padded_vocab_size": (DENSE, {"padded_vocab_size": 512}),
    # the Qwen3-MoE model becomes DeepSeek-V3 (the MLA sizes and DeepSeek's router are refused without it)
    "multi_latent_attention": (MOE, {**DEEPSEEK, "num_layers": MOE["num_layers"]}),
    "qk_pos_emb_head_dim": (DEEPSEEK, {"qk_pos_emb_head_dim": 16}),
    "qk_head_dim": (DEEPSEEK, {"qk_head_dim": 16}),
    "q_lora_rank": (DEEPSEEK, {"q_lora_rank": None}),
    "kv_lora_rank": (DEEPSEEK, {"kv_lora_rank": 32}),
    "v_head_dim": (DEEPSEEK, {"v_head_dim": 16}),
    "num_experts": (MOE, {"num_experts": 8}),
    "n_shared_experts": (DEEPSEEK, {"n_shared_experts": 2}),
    "moe_ffn_hidden_size": (MOE, {"moe_ffn_hidden_size": 64}),
    "moe_router_topk": (MOE, {"moe_router_topk": 1}),
    "first_k_dense_replace": (MOE, {"first_k_dense_replace": 1}),
    "moe_layer_freq": (MOE, {"moe_layer_freq": 2}),
    "moe_router_num_groups": (DEEPSEEK, {"moe_router_num_groups": 4}),
    "moe_router_group_topk": (DEEPSEEK, {"moe_router_group_topk": 2}),
    "moe_router_topk_scaling_factor": (DEEPSEEK, {"moe_router_topk_scaling_factor": 1.0}),
    "norm_topk_prob": (MOE, {"norm_topk_prob": True}),
    # DeepSeek-V3's router is sigmoid with an expert bias: softmax (or no bias) is refused there, and
    # sigmoid (or a bias) anywhere else; the observable change is the refusal naming the key
    "moe_router_score_function": (DEEPSEEK, {"moe_router_score_function": "softmax"}),
    "moe_router_enable_expert_bias": (DEEPSEEK, {"moe_router_enable_expert_bias": False}),
}


def architecture_keys() -> list[str]:
    return [name for name in MegatronConfig.model_fields
            if field_rule(MegatronConfig, name).status is Status.HONOURED and field_rule(MegatronConfig, name).why
            == ARCH_WHY]


def observe(keys: dict):
    """What the plan sizes and init-model builds from ``keys``: the HF config, parameters, KV cache;
    or the refusal (a ConfigError naming the key)."""
    try:
        arch = arch_from_model_yaml("m", keys)
    except ValueError as err:
        return ("refused", str(err))
    return (arch.to_hf_config(), arch.num_params(), arch.kv_cache_bytes_per_token(2))


def test_every_architecture_key_has_an_observer():
    keys = architecture_keys()
    assert len(keys) >= 40, keys  # the architecture block of MegatronConfig
    assert sorted(set(keys) - set(OBSERVERS)) == [], "an architecture key without an observer: add one"
    assert sorted(set(OBSERVERS) - set(keys)) == [], "an observer of a key that is no architecture key"


@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_changing_an_architecture_key_changes_the_model(name):
    base, change = OBSERVERS[name]
    before, after = observe(base), observe({**base, **change})
    assert before[0] != "refused", before
    assert after != before, f"{name}: changing it changed nothing that plan or init-model builds"
    if after[0] == "refused":  # only the router keys: refused with the key's name, not dropped
        assert name in after[1], after


def test_the_reference_marks_no_key_as_read_by_nothing():
    text = render_reference()
    assert "Nothing reads it yet" not in text and "changes nothing that runs" not in text
    assert "Architecture keys" in text
