"""The seed's advanced architecture keys build what they say (posttrain.models.arch_keys): a DeepSeek-V3
model (MLA, shared experts, grouped sigmoid router) whose parameter count is the plan's, RoPE scaling in
the model's ``rope_scaling``, dense layers in a Qwen3-MoE; a value the model cannot carry is refused by key."""

from __future__ import annotations

import copy

import pytest

from posttrain.config.loader import load_model_yaml
from posttrain.config.plan import resolve_plan
from posttrain.config.run import run_config_from_dict
from posttrain.errors import ConfigError
from posttrain.models.arch import arch_from_hf_config, arch_from_model_yaml

DEEPSEEK = {"num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
            "padded_vocab_size": 384, "untie_embeddings_and_output_weights": True, "multi_latent_attention": True,
            "qk_layernorm": True, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 8,
            "v_head_dim": 12, "num_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
            "moe_router_topk_scaling_factor": 2.5, "norm_topk_prob": True, "rope_scaling_type": "yarn",
            "rope_scaling_factor": 4.0, "rope_scaling_original_max_position_embeddings": 256,
            "rope_scaling_mscale_all_dim": 1.0, "max_position_embeddings": 1024, "tokenizer_vocab_size": 300,
            "make_vocab_size_divisible_by": 128}
PLAN_BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 1024, "micro_batch_size": 2},
    "actor_config": {"micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4, "actor_resource": {"num_npus": 1}},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 2048, "sampling_config": {"max_tokens": 512}},
}


def plan_num_params(keys: dict, *overrides: str) -> int:
    raw = copy.deepcopy(PLAN_BASE)
    raw["megatron_training"].update({k: v for k, v in keys.items() if k != "tokenizer_vocab_size"})
    return resolve_plan(run_config_from_dict(raw, overrides=list(overrides)), device="cpu").num_params


def test_init_model_writes_deepseek_v3_whose_size_is_the_plans(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models.init_model import init_model_dir

    out = init_model_dir("tiny_deepseek", DEEPSEEK, tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(out)
    cfg = model.config
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (24, 16, 8, 8, 12)
    assert (cfg.n_routed_experts, cfg.n_shared_experts, cfg.first_k_dense_replace, cfg.n_group, cfg.topk_group,
            cfg.routed_scaling_factor, cfg.num_experts_per_tok) == (4, 1, 1, 2, 1, 2.5, 2)
    assert {k: v for k, v in cfg.rope_scaling.items() if k != "rope_theta"} == {
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 256}
    assert cfg.vocab_size == 384  # 300 tokens padded to a multiple of 128, the yaml's padded_vocab_size
    n = model.num_parameters()
    assert n == plan_num_params(DEEPSEEK) == arch_from_hf_config(out).num_params()
    assert model.model.layers[0].mlp.__class__.__name__ == "DeepseekV3MLP"  # first_k_dense_replace: 1
    assert model.model.layers[1].mlp.__class__.__name__ == "DeepseekV3MoE"
    assert model(torch.tensor([[1, 2, 3, 4]])).logits.shape == (1, 4, 384)


def test_qwen3_moe_dense_layers_and_llama3_rope_scaling(tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.models.init_model import init_model_dir

    keys = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
            "padded_vocab_size": 384, "qk_layernorm": True, "num_experts": 4, "moe_ffn_hidden_size": 32,
            "first_k_dense_replace": 1, "moe_layer_freq": 2, "rope_scaling_type": "llama3",
            "rope_scaling_factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128, "tokenizer_vocab_size": 300, "make_vocab_size_divisible_by": 128}
    out = init_model_dir("tiny_moe", keys, tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.mlp_only_layers == [0, 1, 3]  # layer 0 (first_k), 1 and 3 (i % 2 != 0)
    assert model.config.rope_scaling["rope_type"] == "llama3" and model.config.rope_scaling["factor"] == 8.0
    assert model.num_parameters() == plan_num_params(keys) == arch_from_hf_config(out).num_params()


def test_the_shipped_deepseek_v3_yaml_is_the_671b_model():
    name, keys = load_model_yaml("deepseekv3_671b")
    arch = arch_from_model_yaml(name, keys)
    # DeepSeek-V3's 671B parameters (the 14B of its multi-token-prediction module are not built)
    assert arch.model_type == "deepseek_v3" and round(arch.num_params() / 1e9) == 671
    assert dict(arch.rope_scaling)["rope_type"] == "yarn" and arch.dense_layers == (0, 1, 2)


@pytest.mark.parametrize("change,named", [
    ({"multi_latent_attention": False, "qk_layernorm": False, "n_shared_experts": None,
      "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False, "moe_router_num_groups": None,
      "moe_router_group_topk": None, "moe_router_topk_scaling_factor": None, "first_k_dense_replace": None},
     "q_lora_rank=24: an MLA size, read only with multi_latent_attention: true"),
    ({"multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": None, "qk_head_dim": None,
      "qk_pos_emb_head_dim": None, "v_head_dim": None, "moe_router_score_function": "softmax",
      "moe_router_enable_expert_bias": False}, "n_shared_experts=1: DeepSeek-V3's shared experts"),
    ({"moe_router_score_function": "softmax"}, "moe_router_score_function=softmax"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2: the DeepSeek-V3 model"),
    ({"kv_lora_rank": None}, "multi_latent_attention needs kv_lora_rank"),
    ({"group_query_attention": True, "num_query_groups": 2}, "group_query_attention=True with multi_latent_attention"),
    ({"rope_scaling_type": None}, "rope_scaling_factor=4.0 without rope_scaling_type"),
    ({"rope_scaling_type": "llama3"}, "rope_scaling_mscale_all_dim=1.0: only read with rope_scaling_type: yarn"),
    ({"rope_scaling_type": "dynamic"}, "rope_scaling_type='dynamic': posttrain builds llama3 and yarn"),
    ({"num_experts": None, "first_k_dense_replace": 2}, "set num_experts"),
])
def test_a_key_the_model_cannot_carry_is_refused_by_name(change, named):
    with pytest.raises(ConfigError) as err:
        arch_from_model_yaml("tiny_deepseek", {**DEEPSEEK, **change})
    assert named in str(err.value), str(err.value)


def test_plan_refuses_mla_on_the_megatron_backend_and_keys_without_a_model_to_build():
    with pytest.raises(ConfigError) as err:
        plan_num_params(DEEPSEEK, "actor_config.tensor_model_parallel_size=2", "rl_config.actor_resource.num_npus=2",
                        "actor_config.sequence_parallel=true")
    assert "megatron_training.multi_latent_attention: multi-latent attention (DeepSeek-V3) is not mapped" in \
        str(err.value)
    raw = copy.deepcopy(PLAN_BASE)
    raw["actor_config"].update(rope_scaling_type="yarn", n_shared_experts=1)
    with pytest.raises(ConfigError) as err:
        resolve_plan(run_config_from_dict(raw), device="cpu")
    assert "actor_config.rope_scaling_type, actor_config.n_shared_experts: describe the model that posttrain " \
           "init-model builds" in str(err.value)


def test_lora_sizes_of_mla_use_its_own_projections():
    from posttrain.models.lora import full_rank, lora_sizes

    arch = arch_from_model_yaml("tiny_deepseek", DEEPSEEK)
    # o_proj: 4 heads x 12 value features -> 64; kv_b_proj: 16 -> 4 x (8 + 12); q_b_proj: 24 -> 4 x 16
    assert lora_sizes(arch, ["o_proj", "kv_b_proj"], 2) == (3 * 2 * (48 + 64 + 16 + 80), 3 * (48 * 64 + 16 * 80))
    assert full_rank(arch, ["q_b_proj", "kv_a_proj_with_mqa"]) == 24


def test_a_size_without_the_others_is_refused_not_dropped():
    """A config that loads its model (no sizes) and writes one size: the run would take config.json's."""
    raw = copy.deepcopy(PLAN_BASE)
    raw["actor_config"].update(num_layers=3)
    with pytest.raises(ConfigError) as err:
        resolve_plan(run_config_from_dict(raw), device="cpu")
    assert "actor_config.num_layers: describe the model that posttrain init-model builds and posttrain plan sizes, " \
           "and this config does not give the model's sizes (hidden_size, num_attention_heads, padded_vocab_size)" \
        in str(err.value)
