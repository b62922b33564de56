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
    policy = build_policy(plan, "cpu")
    assert plan.total_optimizer_steps == 30
    assert policy.actor.scheduler.total_steps == 30
    assert policy.reference is None and policy.rollout is not None


def test_without_dynamic_sampling_the_schedule_counts_gbs(mini_qwen2_dir):
    cfg = dapo_config(mini_qwen2_dir)
    policy = build_policy(resolve_plan(cfg, device="cpu"), "cpu")
    assert policy.actor.scheduler.total_steps == 8 // 2 * 3 * 5


def test_dropout_in_the_model_config_is_reported_on_several_workers(caplog):
    from types import SimpleNamespace

    from transformers import GPT2Config, Qwen2Config

    from posttrain.roles.policy import active_dropout, warn_dropout_across_workers

    assert active_dropout(Qwen2Config()) == {}  # the shipped architectures default to 0
    assert active_dropout(Qwen2Config(attention_dropout=0.1)) == {"attention_dropout": 0.1}
    assert set(active_dropout(GPT2Config())) == {"attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_first_dropout"}
    model = SimpleNamespace(config=Qwen2Config(attention_dropout=0.1))
    with caplog.at_level("WARNING", logger="posttrain.roles.policy"):
        warn_dropout_across_workers(model, 1)
        assert not caplog.records
        warn_dropout_across_workers(model, 2)
    assert "attention_dropout" in caplog.text and "docs/cluster.md" in caplog.text


def test_a_resumed_dpo_run_loads_its_reference_from_the_initial_model():
    """The seed's ref_model default is "" (unset): after a resume the reference is the initial model,
    not the resumed policy (the bug: DPO resumed with reference == policy, a loss of log 2)."""
    from posttrain.config.options import policy_options
    from posttrain.roles.policy import reference_source

    cfg = run_config_from_dict({"megatron_training": {"stage": "dpo", "global_batch_size": 2, "micro_batch_size": 1,
                                                      "seq_length": 64, "is_pairwise_dataset": True}})
    assert cfg.actor.ref_model == ""
    policy = policy_options(cfg)
    assert reference_source(policy, {"iteration": 2, "initial_model": "/models/start"}) == "/models/start"
    assert reference_source(policy, {"iteration": 0, "initial_model": "/models/start"}) is None  # a copy of the actor
