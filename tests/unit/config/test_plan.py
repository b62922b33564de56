"""The plan's arithmetic, checked by hand on the seed's r1_zero_qwen25_7b config."""

from __future__ import annotations

import pytest

from posttrain.cli import main
from posttrain.config.plan import GIB, build_plan
from posttrain.config.plan_cmd import model_arch
from posttrain.config.run import load_run_config
from posttrain.config.validate import validate_run_config


@pytest.fixture(scope="module")
def plan():
    cfg = load_run_config("r1_zero_qwen25_7b")
    layout = validate_run_config(cfg)
    return build_plan(cfg, layout, model_arch(cfg))


def test_batch_numbers(plan):
    # gbs 32 prompts x n 16 = 512 responses; mini_batch_size 32 prompts -> 1 mini-batch of 512.
    assert plan.prompts_per_iteration == 32 and plan.responses_per_iteration == 512
    assert plan.mini_batches_per_iteration == 1 and plan.optimizer_steps_per_iteration == 1
    # 8 devices / (TP 4 x PP 2) = actor DP 1; 8 / infer TP 4 = rollout DP 2
    assert (plan.actor_dp, plan.infer_dp) == (1, 2)
    # 512 responses per DP rank / micro_batch_size 4 = 128 micro-batches
    assert plan.grad_accumulation_steps == 128
    # seq_length 4096 bounds prompt (<= 1023) + response (<= 4096); 512 x 4096 tokens
    assert plan.max_tokens_per_sequence == 4096 and plan.max_tokens_per_iteration == 2_097_152
    assert plan.dispatch_sizes["actor_rollout_dispatch_size"] == 256  # 512 // infer DP 2
    assert plan.dispatch_sizes["actor_update_dispatch_size"] == 512  # 512 // actor DP 1


def test_memory_by_hand(plan):
    # Qwen2.5-7B: 28 layers, h 3584, ffn 18944, 28 heads / 4 KV heads, vocab 152064, untied
    layer = (3584 * 3584 + 2 * 3584 * 512 + 3584 * 3584 + (3584 + 2 * 512)  # q,k,v,o + qkv bias
             + 3 * 3584 * 18944 + 2 * 3584)  # mlp + 2 norms
    params = 28 * layer + 2 * 152064 * 3584 + 3584
    assert plan.num_params == params
    assert params == pytest.approx(7.615e9, rel=1e-3)  # the published 7.61B
    shard = params / 8  # TP 4 x PP 2
    m = plan.memory
    assert m.weights == pytest.approx(shard * 2)  # bf16
    assert m.gradients == pytest.approx(shard * 4)  # fp32 main grads
    assert m.optimizer == pytest.approx(shard * 12)  # fp32 master + 2 moments, DP 1
    # activations: 14 layers on this PP stage x s*b*h*34/TP (flash attention) + fp32 logits / TP
    act = 14 * 4096 * 4 * 3584 * 34 / 4 + 4096 * 4 * 152064 * 4 / 4
    assert m.activations == pytest.approx(act)
    # KV: 256 sequences per rollout DP rank x 4096 tokens x (2 x 28 x 4 x 128 x 2 bytes) / infer TP 4
    assert m.kv_cache == pytest.approx(256 * 4096 * 2 * 28 * 4 * 128 * 2 / 4)
    assert m.total / GIB == pytest.approx(38.79, abs=0.01)


def test_plan_command_prints(capsys):
    assert main(["plan", "--config-name", "r1_zero_qwen25_7b"]) == 0
    out = capsys.readouterr().out
    assert "responses" in out and "512" in out and "data parallel 1" in out


def test_plan_command_bad_input_exit_2(capsys):
    assert main(["plan", "--config-name", "r1_zero_qwen25_7b", "rl_config.n_samples_per_prompt=abc"]) == 2
    err = capsys.readouterr().err
    assert "rl_config.n_samples_per_prompt" in err and "Traceback" not in err
    assert main(["plan", "--config-name", "r1_zero_qwen25_7b", "actor_config.micro_batch_size=5"]) == 2
    assert "must be divisible by micro_batch_size 5" in capsys.readouterr().err
    assert main(["plan", "--config-name", "no_such_config"]) == 2


def test_dapo_dynamic_sampling_updates_on_the_kept_prompts():
    cfg = load_run_config("r1_zero_qwen25_7b", overrides=[
        "megatron_training.stage=ray_dapo", "rl_config.filter_groups_enable=true",
        "rl_config.filter_groups_metric=acc", "rl_config.filter_groups_train_batch_size=16",
        "rl_config.mini_batch_size=8"])
    plan = build_plan(cfg, validate_run_config(cfg), None)
    # 32 prompts generated per batch; 16 kept prompts are updated on, in mini-batches of 8 prompts
    assert plan.prompts_per_iteration == 32 and plan.prompts_per_update == 16
    assert plan.mini_batches_per_iteration == 2 and plan.optimizer_steps_per_iteration == 2
