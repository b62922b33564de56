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


@pytest.mark.parametrize("overrides,message", [
    (["rl_config.share_backbone=true"], "The shared backbone can only be used with LoRA."),
    ([*LORA, "rl_config.share_backbone=true", "megatron_training.stage=ray_dapo"],
     "'share_backbone' cannot be True when 'stage' is set to 'ray_dapo'."),
    ([*LORA, "actor_config.lora_r=0"], "actor_config.lora_r=0: "),
    ([*LORA, "actor_config.lora_alpha=-1"], "actor_config.lora_alpha=-1: "),
    ([*LORA, "rl_config.ray_sharding=fsdp2", "rl_config.actor_resource.num_npus=2"],
     "rl_config.ray_sharding=fsdp2 with actor_config.lora_target_modules: FSDP2 with LoRA is not built yet"),
    ([*LORA, "rl_config.rollout_engine=vllm"], "rl_config.rollout_engine=vllm with actor_config.lora_target_modules"),
    ([*LORA, "rl_config.share_backbone=true", "rl_config.offload_reference=true"],
     "rl_config.offload_reference=true with rl_config.share_backbone=true: the reference is the actor's own weights"),
    ([*LORA, "actor_config.tensor_model_parallel_size=2", "rl_config.actor_resource.num_npus=2"],
     "actor_config.lora_target_modules=[linear_qkv, linear_fc1]: LoRA is not built on the megatron backend yet"),
], ids=["share-backbone-without-lora", "share-backbone-dapo", "rank", "alpha", "fsdp2", "vllm", "offload-reference",
        "megatron"])
def test_lora_inputs_that_cannot_run_are_refused_by_key(overrides, message):
    assert refusal(overrides).startswith(message)
