"""The shipped configs load and plan; the seed's large-model layouts select the megatron backend and
are refused on a CPU by the first key a CPU cannot run (the distributed optimizer)."""

import pytest

from posttrain.commands.plan import model_arch
from posttrain.config.plan import build_plan, resolve_plan
from posttrain.config.run import load_run_config
from posttrain.config.validate import validate_run_config
from posttrain.errors import ConfigError

RUNNABLE = ["ppo_tiny_qwen2", "dapo_tiny_qwen2", "dpo_tiny_qwen2", "ppo_smollm2_demo", "dapo_smollm2_demo",
            "dpo_smollm2_demo", "grpo_tiny_qwen2", "grpo_smollm2_demo", "grpo_smollm2_demo_sums", "sft_tiny_qwen2",
            "dapo_tiny_multi_turn", "grpo_tiny_vl_vision_demo"]
SEED_LAYOUTS = ["ppo_qwen25_32b", "dapo_qwen25_32b", "dpo_qwen3_30b_a3b", "r1_zero_qwen25_7b"]


@pytest.mark.parametrize("name", RUNNABLE)
def test_config_plans(name):
    cfg = load_run_config(name)
    plan = resolve_plan(cfg, model_arch(cfg))
    assert cfg.stage == plan.name == name.split("_")[0]


@pytest.mark.parametrize("name", SEED_LAYOUTS)
def test_seed_layouts_are_refused_on_a_cpu_by_key_but_their_arithmetic_plans(name):
    cfg = load_run_config(name)
    refusal = r"use_distributed_optimizer=true: Megatron.*\(backend megatron: .*_parallel_size=\d > 1\)"
    with pytest.raises(ConfigError, match=refusal):
        resolve_plan(cfg, device="cpu")
    assert build_plan(cfg, validate_run_config(cfg), model_arch(cfg)).prompts_per_iteration > 0


def test_seed_examples_keep_their_algorithm_settings():
    ppo = load_run_config("ppo_qwen25_32b")
    assert (ppo.rl.adv_estimator, ppo.rl.gamma, ppo.rl.lam) == ("gae", 1.0, 1.0)
    assert ppo.critic is not None and ppo.critic.tensor_model_parallel_size == 8
    dapo = load_run_config("dapo_qwen25_32b")
    assert dapo.rl.clip_higher_enable and (dapo.rl.clip_ratio_low, dapo.rl.clip_ratio_high) == (0.2, 0.28)
    assert dapo.rl.filter_groups_enable and dapo.rl.filter_groups_metric == "acc_for_dapo" and dapo.ref is None
    dpo = load_run_config("dpo_qwen3_30b_a3b")
    assert dpo.actor.is_pairwise_dataset and dpo.actor.num_experts == 128 and dpo.actor.moe_router_topk == 8


def test_the_seeds_lora_example_fits_its_64_gib_devices_on_the_megatron_backend():
    """grpo_lora_qwen25_32b as the seed laid it out (TP 4 x PP 4 on 16 devices, vLLM at TP 4) on its
    own hardware: the bf16 base split 16 ways, gradients, main params and moments for the adapter
    only, no reference copy (shared backbone), vLLM asleep during the update: it fits 64 GiB."""
    from posttrain.config.target import parse_target

    cfg = load_run_config("grpo_lora_qwen25_32b")
    assert (cfg.actor.lora_r, cfg.actor.lora_alpha, cfg.rl.share_backbone, cfg.actor.lora_ckpt_filter) == \
        (128, 128, True, True)
    plan = resolve_plan(cfg, target=parse_target("npu:64GiB", 2, 8))
    m, par = plan.memory, plan.parallel
    assert plan.lora and (par.backend, par.tp, par.pp, par.dp) == ("megatron", 4, 4, 1) and plan.uses_reference
    assert plan.rollout.engine == "vllm" and plan.rollout.vllm.tensor_parallel_size == 4 and m.rollout_sleeps
    assert m.reference == 0 and m.optimizer == 3 * m.gradients and 0 < m.gradients < m.weights / 10
    assert 2 * plan.num_params / 16 < m.weights < 1.05 * 2 * plan.num_params / 16  # the bf16 base (and adapter) / 16
    assert m.total < 64 * 2**30
