"""Asynchronous rollout (``async_staleness``) on the real vLLM: the trainer's vLLM engine is the
rollout thread's replica. Each iteration samples exactly the version the schedule names (greedy
tokens equal the native engine's on that version's weights), every load is proven by the probe, an
evaluation after the run samples from the trainer's final weights, and k = 0 equals synchronous
training on vLLM (multi-turn, its tool engine in the loop)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from posttrain.loops.pipeline import EngineReplica, RolloutPipeline
from posttrain.metrics.timers import Timers
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine
from tests.helpers.configs import VERIFIERS
from tests.helpers.runs import metrics_by_iteration, world_run_config

GREEDY = SamplingParams(temperature=0.0, top_k=-1, max_tokens=8)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 40))]


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std().clamp_min(1e-3))


def greedy_of(model) -> list[list[int]]:
    outs = NativeEngine(model, pad_token_id=0, eos_token_ids=[]).generate(PROMPTS, 1, GREEDY)
    return [group[0].token_ids for group in outs]


def test_each_iteration_samples_its_version_and_the_end_evaluates_the_trainers(vllm_qwen2):
    from posttrain.rollout.vllm_engine import VLLMEngine

    model = copy.deepcopy(vllm_qwen2)
    engine = VLLMEngine(copy.deepcopy(model), eos_token_ids=[], dtype="float32", max_model_len=256, max_num_seqs=16,
                        max_num_batched_tokens=256)
    versions = [greedy_of(model)]  # the greedy tokens of version v (the weights after v updates)

    def produce(iteration, eng, version):  # the rollout thread: generate while the trainer updates
        return SimpleNamespace(timers=Timers(), version=version,
                               tokens=[g[0].token_ids for g in eng.generate(PROMPTS, 1, GREEDY)])

    last = 4
    pipeline = RolloutPipeline(produce, EngineReplica(engine), staleness=1, start=0, last=last)
    try:
        for iteration in range(1, last + 1):
            exp, _, _ = pipeline.experience(iteration)
            assert exp.version == max(0, iteration - 2)
            assert exp.tokens == versions[exp.version], iteration
            perturb(model, seed=iteration)  # the update
            versions.append(greedy_of(model))
            pipeline.publish(iteration, model)
        with pipeline.drained():  # the final save and evaluation
            pipeline.hold_published(model)
            assert pipeline.loaded == last
            got = [g[0].token_ids for g in engine.generate(PROMPTS, 1, GREEDY)]
    finally:
        pipeline.close()
    assert got == versions[last]
    assert len({tuple(map(tuple, v)) for v in versions}) == len(versions)  # every version samples differently
    assert engine.pop_metrics()["rollout/sync_probe_diff"] < 1e-4


# multi-turn with the search tool (no sandbox needed): the vLLM tool engine in the loop too
MULTI_TURN = {"multi_turn_enable": True, "async_engine": True, "tool_config_path": "configs/tools/search.yaml",
              "max_tool_calls": 2, "max_total_response_length": 24}


def run(world, path, **rl):
    from posttrain.commands.train import train_config as train

    dense = {"verifier_function": ["e2e_lowercase"], "verifier_modules": [VERIFIERS]}  # varies: the weights move
    train(world_run_config(world, path, iters=3, rl_config={"rollout_engine": "vllm", **MULTI_TURN, **dense, **rl},
                           actor_config={"prompt_type": "qwen_retool"},
                           megatron_training={"global_batch_size": 2, "micro_batch_size": 4, "lr": 1e-2,
                                              "save_interval": 1}))
    return metrics_by_iteration(path / "out")


def test_staleness_zero_on_vllm_equals_synchronous_training(vllm_world, tmp_path, one_thread):
    """Multi-turn GRPO on vLLM, synchronous and with async_staleness 0: the same run (the random
    model writes no tool call, so the tool engine's plumbing is what this covers in the loop)."""
    sync, k0 = run(vllm_world, tmp_path / "sync"), run(vllm_world, tmp_path / "k0", async_staleness=0)
    assert sorted(k0) == [1, 2, 3]
    for it in (1, 2, 3):
        assert k0[it]["rollout/staleness_max"] == 0
        assert k0[it]["rollout/sync_probe_diff"] < 1e-4
        assert k0[it]["tool_call_num/max"] == 0 and k0[it]["response_length/mean"] > 0
        for key, value in sync[it].items():
            if isinstance(value, (int, float)) and not key.startswith(("timing/", "rollout/sync_probe")) \
                    and not key.endswith("_tps") and key != "time":
                assert k0[it][key] == pytest.approx(value, abs=1e-5, rel=1e-5), (it, key)
    assert k0[1]["actor/grad_norm"] > 0  # the (tied) embedding changed: its sync is proven at iteration 2
