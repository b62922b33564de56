"""The plan's arithmetic, checked by hand on the seed's r1_zero_qwen25_7b config; what ``plan``
refuses and what its memory estimate describes."""

from __future__ import annotations

import pytest

from posttrain.cli import main
from posttrain.commands.plan import model_arch
from posttrain.config.plan import build_plan, resolve_plan
from posttrain.config.run import load_run_config
from posttrain.config.validate import validate_run_config


@pytest.fixture(scope="module")
def plan():
    cfg = load_run_config("r1_zero_qwen25_7b")
    return build_plan(cfg, validate_run_config(cfg), model_arch(cfg))


def test_batch_numbers(plan):
    # gbs 32 prompts x n 16 = 512 responses; mini_batch_size 32 prompts -> 1 mini-batch of 512.
    assert plan.prompts_per_iteration == 32 and plan.responses_per_iteration == 512
    assert plan.mini_batches_per_iteration == 1 and plan.optimizer_steps_per_iteration == 1
    # 8 devices / (TP 4 x PP 2) = actor DP 1; 8 / infer TP 4 = rollout DP 2
    assert (plan.layout.actor_dp, plan.layout.infer_dp) == (1, 2)
    # 512 responses per DP rank / micro_batch_size 4 = 128 micro-batches
    assert plan.grad_accumulation_steps == 128
    # seq_length 4096 bounds prompt (<= 1023) + response (<= 4096); 512 x 4096 tokens
    assert plan.max_tokens_per_sequence == 4096 and plan.max_tokens_per_iteration == 2_097_152
    assert plan.dispatch_sizes["actor_rollout_dispatch_size"] == 256  # 512 // infer DP 2
    assert plan.dispatch_sizes["actor_update_dispatch_size"] == 512  # 512 // actor DP 1


# Qwen2.5-7B: 28 layers, h 3584, ffn 18944, 28 heads / 4 KV heads, vocab 152064, untied
LAYER = (3584 * 3584 + 2 * 3584 * 512 + 3584 * 3584 + (3584 + 2 * 512)  # q,k,v,o + qkv bias
         + 3 * 3584 * 18944 + 2 * 3584)  # mlp + 2 norms
PARAMS = 28 * LAYER + 2 * 152064 * 3584 + 3584
# a 7B run estimates ~400 GiB per process: on a CPU-only machine plan refuses it unless told to ignore that
ONE_PROCESS = ["actor_config.tensor_model_parallel_size=1", "actor_config.pipeline_model_parallel_size=1",
               "rl_config.actor_resource.num_npus=1", "generate_config.infer_tensor_parallel_size=1",
               "rl_config.ignore_memory_estimate=true"]


def test_memory_by_hand_for_the_layout_that_runs():
    cfg = load_run_config("r1_zero_qwen25_7b", overrides=ONE_PROCESS)
    plan = resolve_plan(cfg, model_arch(cfg), device="cpu")
    assert plan.num_params == PARAMS and PARAMS == pytest.approx(7.615e9, rel=1e-3)  # the published 7.61B
    assert not plan.use_ray and plan.workers == 1  # the autocast dtype (bf16 where the CPU has it) changes no byte below
    m = plan.memory
    # fp32 master weights, fp32 gradients, AdamW's two fp32 moments: one whole replica in one process
    assert (m.weights, m.gradients, m.optimizer) == (4 * PARAMS, 4 * PARAMS, 8 * PARAMS)
    assert m.reference == 0 and m.critic == 0  # init_kl_coef 0: no reference; GRPO: no critic
    # activations: 28 layers x s*b*h*34 (memory-efficient attention) + fp32 logits
    assert m.activations == pytest.approx(28 * 4096 * 4 * 3584 * 34 + 4096 * 4 * 152064 * 4)
    # KV: 512 sequences (max_num_seqs 512 >= the 512 responses) x 4096 tokens x 2 x 28 layers x 4 KV heads x 128 x bytes
    kv_bytes = 2 if plan.rollout_dtype == "bfloat16" else 4
    assert m.kv_cache == pytest.approx(512 * 4096 * 2 * 28 * 4 * 128 * kv_bytes)


def test_memory_shards_with_fsdp2_and_counts_the_reference():
    cfg = load_run_config("r1_zero_qwen25_7b", overrides=ONE_PROCESS + [
        "rl_config.actor_resource.num_npus=4", "rl_config.ray_sharding=fsdp2", "rl_config.init_kl_coef=0.001"])
    plan = resolve_plan(cfg, model_arch(cfg), device="cpu")
    assert plan.use_ray and plan.workers == 4
    assert plan.memory.weights == pytest.approx(PARAMS)  # 4 bytes / 4 workers
    assert plan.memory.optimizer == pytest.approx(2 * PARAMS)
    assert plan.memory.reference == 4 * PARAMS  # the frozen copy is whole on every worker


def test_plan_command_prints(capsys):
    assert main(["plan", "--config-only", "--config-name", "grpo_tiny_qwen2"]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "responses" in out and "optimizer steps in all" in out


def test_plan_refuses_the_distributed_optimizer_of_the_megatron_backend_on_cpu(capsys):
    """The seed's TP4 x PP2 config selects the megatron backend; on a CPU its distributed optimizer
    is refused by key, with the reason for the backend."""
    assert main(["plan", "--config-name", "r1_zero_qwen25_7b", "rl_config.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "megatron_training.use_distributed_optimizer=true: Megatron-Core's distributed optimizer needs CUDA" in err
    assert "(backend megatron: actor_config.tensor_model_parallel_size=4 > 1)" in err
    assert main(["plan", "--config-only", "--config-name", "r1_zero_qwen25_7b", *ONE_PROCESS]) == 0


MEGATRON_CPU = ["rl_config.device=cpu", "actor_config.use_distributed_optimizer=false",
                "rl_config.ignore_memory_estimate=true"]


def test_r1_zero_plans_on_the_megatron_backend(capsys):
    cfg = load_run_config("r1_zero_qwen25_7b", overrides=MEGATRON_CPU)
    plan = resolve_plan(cfg, model_arch(cfg), device="cpu")
    par = plan.parallel
    assert (par.backend, par.tp, par.pp, par.dp, par.cp) == ("megatron", 4, 2, 1, 1)
    assert par.reason == "actor_config.tensor_model_parallel_size=4 > 1"
    assert plan.workers == 8 and plan.use_ray  # every worker process, whatever its TP/PP rank
    # one DP rank: the driver reads one dispatch per call, not one per worker
    assert plan.reads["actor_update_dispatch_size"] == plan.dispatch_sizes["actor_update_dispatch_size"] == 512
    # weights, gradients, AdamW moments: 1/(TP x PP) of the model per process
    assert plan.memory.weights == pytest.approx(4 * PARAMS / 8) and plan.memory.optimizer == pytest.approx(PARAMS)
    # on a CPU the optimizer state and the weights have nowhere to go: warned (the gradients are freed)
    [keys] = [w for w in plan.warnings if w.startswith("keys with no effect")]
    assert all(f"generate_config.offload_train_{k}" in keys for k in ("optimizer", "param"))
    assert "offload_train_grad" not in keys and plan.offload_grads
    assert "sequence_parallel" not in keys and "use_distributed_optimizer" not in keys  # honoured / refused
    assert main(["plan", "--config-only", "--config-name", "r1_zero_qwen25_7b", *MEGATRON_CPU]) == 0
    out = capsys.readouterr().out
    assert "backend: megatron (actor_config.tensor_model_parallel_size=4 > 1): TP 4 x PP 2 x DP 1, sequence parallel\n" in out


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
    # the LR schedule's length counts the kept prompts' steps (not gbs // mini_batch_size)
    assert plan.total_optimizer_steps == 2 * cfg.actor.train_iters


def test_data_strategy_spellings_reach_the_plan():
    """The seed's spellings of data_strategy: tq / transfer_queue / queue run on TransferQueue with the shard
    count; td / transfer_dock / dock on the TransferDock; another value names the key and the choices."""
    from posttrain.errors import ConfigError

    for spelling, want in (("queue", "tq"), ("transfer_queue", "tq"), ("dock", "td")):
        shards = ["rl_config.transfer_queue_data_shard_num=3"] if want == "tq" else []
        cfg = load_run_config("r1_zero_qwen25_7b",
                              overrides=[*ONE_PROCESS, f"rl_config.data_strategy={spelling}", *shards])
        plan = build_plan(cfg, validate_run_config(cfg), model_arch(cfg))
        assert (plan.data_strategy, plan.queue_shards) == (want, 3 if want == "tq" else 1)
    with pytest.raises(ConfigError, match="data_strategy='redis': must be one of td, transfer_dock, dock, tq, transfer_queue, queue"):
        load_run_config("r1_zero_qwen25_7b", overrides=["rl_config.data_strategy=redis"])


def test_a_multimodal_plan_carries_its_keys_and_says_them():
    from posttrain.commands.plan import format_plan

    mm = ["rl_config.is_multimodal=true", "rl_config.eval_data_path=null", "rl_config.freeze_vision_tower=true",
          "rl_config.reuse_image_embeds=true", "rl_config.vit_forward_micro_batch_size=2",
          "generate_config.limit_mm_image_per_prompt=3"]
    cfg = load_run_config("grpo_tiny_qwen2", overrides=mm)
    plan = build_plan(cfg, validate_run_config(cfg))
    m = plan.multimodal
    # the image_embeds read: gbs x n // actor DP, derived as the seed's other dispatch sizes
    gbs_n = plan.responses_per_iteration
    assert (m.images_per_prompt, m.freeze_vision_tower, m.reuse_image_embeds, m.vit_micro_batch_size,
            m.embeds_dispatch_size) == (3, True, True, 2, gbs_n)
    assert ("multimodal" + " " * 36 + " <= 3 image(s) a prompt; vision tower frozen; image embeddings computed "
            f"once per iteration, {gbs_n} rows a read") in format_plan(plan)
    text = load_run_config("grpo_tiny_qwen2")
    assert build_plan(text, validate_run_config(text)).multimodal is None
