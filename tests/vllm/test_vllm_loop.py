"""GRPO in one process (hf backend) with ``rollout_engine: vllm``: every iteration's sync is proven
(``rollout/sync_probe_diff`` < 1e-4 in fp32) and timed, every sampled token's log-prob is the
trainer's (``rollout/logprob_diff_max``, so the rollout sampled from the weights just trained), and a
greedy run equals the native engine's (the same sampled tokens, so the same rewards and losses)."""

from __future__ import annotations

import pytest

from tests.helpers.configs import VERIFIERS
from tests.helpers.runs import metrics_by_iteration, world_run_config

GREEDY = {"max_num_seqs": 16, "sampling_config": {"max_tokens": 4, "temperature": 0.0, "top_k": -1, "top_p": 1.0}}


def run(world, path, engine: str, iters: int = 3, **sections):
    from posttrain.commands.train import train_config as train

    rl = {"rollout_engine": engine, **sections.pop("rl_config", {})}
    train(world_run_config(world, path, iters=iters, rl_config=rl, **sections))
    return metrics_by_iteration(path / "out")


@pytest.fixture(scope="module")
def greedy_runs(vllm_world, tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("greedy")
    return {engine: run(vllm_world, root / engine, engine, generate_config=GREEDY) for engine in ("vllm", "native")}


def test_every_sync_is_proven_and_timed(greedy_runs):
    metrics = greedy_runs["vllm"]
    assert sorted(metrics) == [1, 2, 3]
    for it, row in metrics.items():
        assert row["rollout/sync_probe_diff"] < 1e-4, (it, row["rollout/sync_probe_diff"])
    assert all(metrics[it]["timing/resharding_to_infer"] > 0 for it in (1, 2))


def test_every_rollout_samples_from_the_trained_weights(vllm_world, tmp_path, one_thread):
    """Two mini-batches per iteration, so the trainer computes old log-probs and compares them with
    the rollout's for the same tokens (T = 1, no truncation)."""
    metrics = run(vllm_world, tmp_path, "vllm", rl_config={"mini_batch_size": 1},
                  megatron_training={"global_batch_size": 2, "micro_batch_size": 2, "lr": 1e-3, "save_interval": 1})
    for it, row in metrics.items():
        assert row["rollout/sync_probe_diff"] < 1e-4, (it, row)
        assert row["rollout/logprob_diff_max"] < 1e-4, (it, row)
        assert row["response_length/mean"] > 0


def test_a_greedy_run_equals_the_native_engines(greedy_runs):
    vllm, native = greedy_runs["vllm"], greedy_runs["native"]
    shared = [k for k in native[1] if k in vllm[1] and not k.startswith(("timing/", "e2e_tps", "update_tps",
                                                                             "vllm_tps", "rollout/"))]
    assert {"grpo/rewards/mean", "actor/pg_loss", "response_length/mean"} <= set(shared) or len(shared) > 10, shared
    for it in (1, 2, 3):
        for key in shared:
            if isinstance(native[it][key], (int, float)):
                assert vllm[it][key] == pytest.approx(native[it][key], abs=1e-3, rel=1e-3), (it, key)


def test_lora_pushes_the_merged_weights_at_every_sync(vllm_world, tmp_path, one_thread):
    """With a LoRA adapter the engine holds the adapted model: the probe and every sampled token's
    log-prob match the trainer's (adapter on) after each update, while the adapter moves away from
    its zero start (an unbound adapter would show as a log-prob difference from iteration 2)."""
    lora = {"lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "lora_r": 4,
            "lora_alpha": 8}
    dense = {"verifier_function": ["e2e_lowercase"], "verifier_modules": [VERIFIERS]}  # varies on a random model
    metrics = run(vllm_world, tmp_path, "vllm", rl_config={"mini_batch_size": 1, **dense},
                  actor_config={"save": str(tmp_path / "ckpt"), **lora},
                  megatron_training={"global_batch_size": 2, "micro_batch_size": 2, "lr": 5e-2, "save_interval": 1})
    for it, row in metrics.items():
        assert row["rollout/sync_probe_diff"] < 1e-4, (it, row)
        assert row["rollout/logprob_diff_max"] < 1e-4, (it, row)
    assert metrics[1]["actor/grad_norm"] > 0  # the adapter moved before iteration 2 sampled


def test_distillation_scores_the_tokens_vllm_sampled(vllm_world, tmp_path, one_thread):
    """rl_config.teacher_model with vLLM's samples: the teacher is the starting model and the learning
    rate too small to move it, so the teacher's log-prob of every sampled token equals vLLM's and the
    reverse-KL estimate is zero at every iteration (a teacher read at shifted positions is ~1 nat off)."""
    metrics = run(vllm_world, tmp_path, "vllm", iters=2,
                  rl_config={"teacher_model": str(vllm_world / "model"), "mini_batch_size": 1},
                  megatron_training={"global_batch_size": 2, "micro_batch_size": 2, "lr": 1e-20})
    for it, row in metrics.items():
        assert row["distill/student_logprob"] < -1.0, (it, row)
        assert abs(row["distill/reverse_kl"]) < 1e-4, (it, row)
