"""The separate rollout worker (``separate_rollout_worker: true``) with vLLM: the worker process holds
its own vLLM engine, synced (and proven by the probe) with every version it loads."""

from __future__ import annotations


import pytest

from tests.helpers.configs import VERIFIERS
from tests.helpers.local_ray import local_ray
from tests.helpers.runs import metrics_by_iteration, world_run_config

pytestmark = [pytest.mark.ray]  # a local Ray cluster and two vLLM engines: about a minute on 2 cores


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray")
    with local_ray(2, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1") as ray:
        yield ray


def test_the_rollout_worker_samples_each_version_on_its_own_vllm(vllm_world, tmp_path, ray_cluster, one_thread):
    """``async_staleness: 1``: iterations 1 and 2 sample version 0, iteration 3 version 1. The worker's
    vLLM engine is proven after its start and after the load of version 1; its log-probs are the
    trainer's at iteration 1 (the same weights) and not at iteration 2 (one update behind)."""
    from posttrain.commands.train import train_config as train

    rl = {"rollout_engine": "vllm", "async_staleness": 1, "separate_rollout_worker": True, "mini_batch_size": 1,
          "verifier_function": ["e2e_lowercase"], "verifier_modules": [VERIFIERS]}  # a reward that varies: updates move
    train(world_run_config(vllm_world, tmp_path, iters=3, rl_config=rl,
                           megatron_training={"global_batch_size": 2, "micro_batch_size": 2, "lr": 1e-2,
                                              "save_interval": 1}))
    metrics = metrics_by_iteration(tmp_path / "out")
    assert sorted(metrics) == [1, 2, 3]
    assert [metrics[it]["rollout/staleness_max"] for it in (1, 2, 3)] == [0, 1, 1]
    assert metrics[1]["rollout/sync_probe_diff"] < 1e-4 and metrics[3]["rollout/sync_probe_diff"] < 1e-4
    assert "rollout/sync_probe_diff" not in metrics[2]  # iteration 2 loads nothing: version 0 again
    assert metrics[1]["rollout/logprob_diff_max"] < 1e-4
    assert metrics[1]["actor/grad_norm"] > 0  # update 1 moved the weights (the tied embedding too) ...
    assert metrics[2]["rollout/logprob_diff_max"] > 1e-4  # ... so iteration 2 sampled one version behind
