"""LoRA's keys on the hf backend (their ranges on the fields, the compatibility table's LoRA rows and
the seed's share_backbone rules): each bad input fails before training, naming the key."""

from __future__ import annotations

import copy

import pytest

from posttrain.config.check import check_run_config
from posttrain.config.run import run_config_from_dict
from posttrain.errors import ConfigError

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 1024, "micro_batch_size": 2},
    "actor_config": {"micro_batch_size": 2},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 2048, "sampling_config": {"max_tokens": 512}},
}
LORA = ["actor_config.lora_target_modules=[linear_qkv,linear_fc1]"]


def check(overrides):
    return check_run_config(run_config_from_dict(copy.deepcopy(BASE), overrides=list(overrides)), device_type="cpu")


def refusal(overrides) -> str:
    with pytest.raises(ConfigError) as err:
        check(overrides)
    return str(err.value)


def test_lora_keys_are_honoured_on_the_hf_backend():
    _, warnings = check([*LORA, "actor_config.lora_r=16", "actor_config.lora_alpha=32",
                         "actor_config.lora_ckpt_filter=true", "rl_config.share_backbone=true"])
    assert not any("lora" in w or "share_backbone" in w for w in warnings)
    _, warnings = check([*LORA, "actor_config.lora_fusion=true"])  # MindSpeed's fused kernels: no effect
    assert any("actor_config.lora_fusion" in w for w in warnings)
    _, warnings = check([*LORA, "rl_config.ray_sharding=fsdp2", "rl_config.actor_resource.num_npus=2",
                         "rl_config.share_backbone=true"])  # FSDP2 shards the PEFT model, frozen base included
    assert not any("lora" in w or "fsdp2" in w for w in warnings)


@pytest.mark.parametrize("overrides,message", [
    (["rl_config.share_backbone=true"], "The shared backbone can only be used with LoRA."),
    ([*LORA, "rl_config.share_backbone=true", "megatron_training.stage=ray_dapo"],
     "'share_backbone' cannot be True when 'stage' is set to 'ray_dapo'."),
    ([*LORA, "actor_config.lora_r=0"], "actor_config.lora_r=0: "),
    ([*LORA, "actor_config.lora_alpha=-1"], "actor_config.lora_alpha=-1: "),
    ([*LORA, "rl_config.share_backbone=true", "rl_config.offload_reference=true"],
     "rl_config.offload_reference=true with rl_config.share_backbone=true: the reference is the actor's own weights"),
    ([*LORA, "actor_config.tensor_model_parallel_size=2", "rl_config.actor_resource.num_npus=2",
      "actor_config.lora_target_modules=[linear_qkv, embed_tokens]"],
     "actor_config.lora_target_modules: 'embed_tokens' is not a linear of a Megatron layer"),
], ids=["share-backbone-without-lora", "share-backbone-dapo", "rank", "alpha", "offload-reference", "megatron-target"])
def test_lora_inputs_that_cannot_run_are_refused_by_key(overrides, message):
    assert refusal(overrides).startswith(message)


# ---- probe 3 (docs/reliability/probe3_cmds.md) -------------------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    (["actor_config.lora_r=8", "actor_config.lora_alpha=16", "actor_config.lora_target_modules=[]"],
     "actor_config.lora_target_modules=[]: names no layer, so no adapter would be trained"),
    (["actor_config.lora_r=8", "actor_config.lora_target_modules="],
     "actor_config.lora_target_modules='': names no layer"),
    (["actor_config.lora_r=16"], "actor_config.lora_r=16 without lora_target_modules: LoRA is off"),
    ([*LORA, "rl_config.share_backbone=true", "rl_config.integrated_mode_config.ref_model_load_path=/m/ref"],
     "rl_config.integrated_mode_config.ref_model_load_path=/m/ref with rl_config.share_backbone=true: with "
     "share_backbone the reference is the actor's base weights"),
], ids=["L4b_empty_list", "L4b_empty_string", "CM42_rank_without_targets", "L16d_shared_backbone_reference"])
def test_lora_keys_that_would_be_ignored_are_refused(overrides, message):
    """Probes L4b (an empty target list: a silent full fine-tune), CM42 (a rank without targets) and
    L16d (share_backbone ignored ref_model_load_path without a word)."""
    assert refusal(overrides).startswith(message)


def test_a_rank_above_the_layers_full_rank_is_refused():
    """Probe CM40: lora_r 100000 on q_proj and v_proj of a model whose v_proj has 32 outputs."""
    from posttrain.models.arch import ModelArch

    arch = ModelArch(model_type="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_kv_heads=2, head_dim=16, vocab_size=256, tie_embeddings=True)
    cfg = run_config_from_dict(copy.deepcopy(BASE), overrides=["actor_config.lora_target_modules=[q_proj,v_proj]",
                                                               "actor_config.lora_r=100000"])
    with pytest.raises(ConfigError, match=r"^actor_config.lora_r=100000 is above 32, the full rank"):
        check_run_config(cfg, arch=arch)
    cfg = run_config_from_dict(copy.deepcopy(BASE), overrides=["actor_config.lora_target_modules=[q_proj,v_proj]",
                                                               "actor_config.lora_r=32"])
    check_run_config(cfg, arch=arch)
