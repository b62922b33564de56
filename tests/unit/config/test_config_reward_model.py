"""reward_config, rl_config.rule_reward, reward_resource and reward_model_weight: what runs, and the
combinations that are refused with the keys named."""

from __future__ import annotations

import copy
import re

import pytest

from posttrain.config.check import check_run_config
from posttrain.config.plan import resolve_plan
from posttrain.config.run import run_config_from_dict
from posttrain.errors import ConfigError

BASE = {
    "megatron_training": {"stage": "ray_grpo", "global_batch_size": 8, "seq_length": 256, "micro_batch_size": 4,
                          "bf16": False},
    "rl_config": {"n_samples_per_prompt": 4, "mini_batch_size": 4},
    "generate_config": {"infer_tensor_parallel_size": 1, "max_model_len": 512, "sampling_config": {"max_tokens": 128}},
}
RM = ["reward_config.load=/models/rm"]


def config(overrides=(), base=BASE):
    return run_config_from_dict(copy.deepcopy(base), overrides=list(overrides))


def refusal(overrides, base=BASE) -> str:
    with pytest.raises(ConfigError) as err:
        check_run_config(config(overrides, base))
    return str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (["rl_config.rule_reward=false"],
     r"^rl_config.rule_reward=false and no reward_config: nothing would score the responses; set rule_reward: "
     r"true .* or add a reward_config section whose load names a reward model"),
    (["rl_config.reward_resource.num_npus=1"],
     r"^rl_config.reward_resource=\{num_npus: 1\}: there is no reward model to place \(no reward_config\)"),
    (["rl_config.reward_model_weight=0.5"],
     r"^rl_config.reward_model_weight=0.5: there is no reward model to weigh \(no reward_config\)"),
    ([*RM, "rl_config.reward_resource.num_npus=2"],
     r"^rl_config.reward_resource=\{num_npus: 2\}: in integrated mode the reward model runs on the actor's devices "
     r".*give it "
     r"actor_resource's num_npus"),
    (["reward_config.micro_batch_size=2"], r"^reward_config names no reward model: set reward_config.load"),
    (["megatron_training.load=/models/actor", "reward_config.micro_batch_size=2"],
     r"^reward_config names no reward model: .*merged in from megatron_training is the actor's"),
    ([*RM, "rl_config.rule_reward=false", "rl_config.reward_model_weight=0"],
     r"^rl_config.rule_reward=false with rl_config.reward_model_weight=0: every score would be 0"),
    ([*RM, "rl_config.reward_model_weight=nan"], r"^rl_config.reward_model_weight=nan: must be a finite number"),
    ([*RM, "rl_config.rule_reward=false", "rl_config.overlong_buffer_enable=true", "rl_config.overlong_buffer=16",
      "rl_config.rollout_max_tokens=128"],
     r"^rl_config.overlong_buffer_enable=true with rl_config.rule_reward=false: the DAPO overlong penalty"),
    ([*RM, "rl_config.rule_reward=false", "megatron_training.stage=ray_dapo", "rl_config.filter_groups_enable=true",
      "rl_config.filter_groups_train_batch_size=4", "rl_config.verifier_function=[acc]",
      "rl_config.filter_groups_metric=acc"],
     r"^rl_config.filter_groups_enable=true with rl_config.rule_reward=false: dynamic sampling keeps the groups "
     r"whose verifier scores vary \(filter_groups_metric=acc\)"),
    ([*RM, "reward_config.lr=0.5"],
     r"^reward_config.lr=0.5: the reward model is frozen and reads only reward_config.load .*give it the actor's "
     r"value \(null\)"),
    ([*RM, "reward_config.tensor_model_parallel_size=2"], r"^reward_config.tensor_model_parallel_size=2: "
     r"tensor/pipeline/expert parallelism needs backend megatron"),
    ([*RM, "reward_config.micro_batch_size=3"],
     r"^Invalid Reward batch configuration! \(global_batch_size \* n_samples\) = 8\*4 = 32 must be divisible by "
     r"micro_batch_size 3"),
])
def test_refusals_name_the_keys(overrides, message):
    got = refusal(overrides)
    assert re.search(message, got), got


def test_offline_stages_refuse_reward_config():
    base = copy.deepcopy(BASE)
    base["megatron_training"].update(stage="dpo", is_pairwise_dataset=True)
    assert refusal(RM, base).startswith("reward_config: stage dpo scores no responses (a reward model is read by the "
                                        "on-policy stages ray_grpo, ray_dapo and ray_ppo); remove reward_config")


def test_accepted_settings_and_the_plan(lowercase_rm_dir):
    """A reward model alone, a colocated reward_resource, keys equal to the actor's, and what the plan holds."""
    from posttrain.commands.plan import format_plan
    from posttrain.models.arch import arch_from_hf_config

    cfg = config([f"reward_config.load={lowercase_rm_dir}", "rl_config.rule_reward=false",
                  "rl_config.reward_resource.num_npus=1", "rl_config.reward_model_weight=2.5",
                  "reward_config.seq_length=256", "reward_config.micro_batch_size=8"])
    check_run_config(cfg)
    plan = resolve_plan(cfg, arch_from_hf_config(lowercase_rm_dir), device="cpu")
    rm = plan.reward_model
    assert (rm.path, rm.dtype, rm.micro_batch_size, rm.weight) == (str(lowercase_rm_dir), "float32", 8, 2.5)
    assert plan.memory.reward_model > 0 and plan.memory.total > plan.memory.weights + plan.memory.reward_model
    text = format_plan(plan)
    assert "reward model (colocated with the actor)" in text and "weight 2.5" in text
    assert "reward model (frozen weights)" in text
    # the reward model's micro-batch defaults to the actor's; no reward_config, no reward model
    assert resolve_plan(config(RM), device="cpu").reward_model.micro_batch_size == 4
    assert resolve_plan(config(), device="cpu").reward_model is None
