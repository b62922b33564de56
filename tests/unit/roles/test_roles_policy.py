"""The policy role built from a config and its plan: the LR schedule's length, the reference."""

from __future__ import annotations

from posttrain.config.plan import resolve_plan
from posttrain.config.run import run_config_from_dict
from posttrain.roles.policy import build_policy


def dapo_config(model_dir, **rl):
    return run_config_from_dict({
        "megatron_training": {"stage": "ray_dapo", "global_batch_size": 8, "micro_batch_size": 4, "seq_length": 64,
                              "train_iters": 5, "lr": 1e-3, "lr_decay_style": "cosine",
                              "tokenizer_name_or_path": str(model_dir), "bf16": False, "prompt_type": "trl"},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "epochs": 3, "device": "cpu",
                      "verifier_function": ["acc"], "verifier_weight": [1.0], **rl},
        "generate_config": {"max_model_len": 64, "infer_tensor_parallel_size": 1, "sampling_config": {"max_tokens": 8}},
    })


def test_lr_schedule_counts_the_dapo_update_batch(mini_qwen2_dir):
    """DAPO with dynamic sampling updates on filter_groups_train_batch_size prompts: 4 kept prompts /
    mini-batches of 2 x 3 epochs x 5 iterations = 30 steps (gbs 8 would give 60: the old bug)."""
    cfg = dapo_config(mini_qwen2_dir, filter_groups_enable=True, filter_groups_metric="acc",
                      filter_groups_train_batch_size=4)
    plan = resolve_plan(cfg, device="cpu")
    policy = build_policy(cfg, plan, "cpu")
    assert plan.total_optimizer_steps == 30
    assert policy.actor.scheduler.total_steps == 30
    assert policy.reference is None and policy.rollout is not None


def test_without_dynamic_sampling_the_schedule_counts_gbs(mini_qwen2_dir):
    cfg = dapo_config(mini_qwen2_dir)
    policy = build_policy(cfg, resolve_plan(cfg, device="cpu"), "cpu")
    assert policy.actor.scheduler.total_steps == 8 // 2 * 3 * 5
