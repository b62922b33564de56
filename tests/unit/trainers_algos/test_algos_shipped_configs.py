"""The shipped PPO / DAPO / DPO configs load, validate (seed rules + algorithm checks) and plan."""

import pytest

from posttrain.config.plan import build_plan
from posttrain.config.plan_cmd import model_arch
from posttrain.config.run import load_run_config
from posttrain.config.validate import validate_run_config
from posttrain.trainers.bundles import check_algorithm_config

CONFIGS = ["ppo_tiny_qwen2", "dapo_tiny_qwen2", "dpo_tiny_qwen2", "ppo_smollm2_demo", "dapo_smollm2_demo",
           "dpo_smollm2_demo", "ppo_qwen25_32b", "dapo_qwen25_32b", "dpo_qwen3_30b_a3b"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates(name):
    cfg = load_run_config(name)
    layout = validate_run_config(cfg)
    check_algorithm_config(cfg)
    assert cfg.stage == name.split("_")[0]
    build_plan(cfg, layout, model_arch(cfg))


def test_seed_examples_keep_their_algorithm_settings():
    ppo = load_run_config("ppo_qwen25_32b")
    assert (ppo.rl.adv_estimator, ppo.rl.gamma, ppo.rl.lam) == ("gae", 1.0, 1.0)
    assert ppo.critic is not None and ppo.critic.tensor_model_parallel_size == 8
    dapo = load_run_config("dapo_qwen25_32b")
    assert dapo.rl.clip_higher_enable and (dapo.rl.clip_ratio_low, dapo.rl.clip_ratio_high) == (0.2, 0.28)
    assert dapo.rl.filter_groups_enable and dapo.rl.filter_groups_metric == "acc_for_dapo" and dapo.ref is None
    dpo = load_run_config("dpo_qwen3_30b_a3b")
    assert dpo.actor.is_pairwise_dataset and dpo.actor.num_experts == 128 and dpo.actor.moe_router_topk == 8
