"""Partial rollout (``partial_rollout_max_split > 1``) on the real vLLM: a continued sample is a new
request on its prompt plus its tokens so far, with the rest of its budget. In fp32 greedy the rollout
dock's rounds, over iterations whose weights change in between (synced into vLLM), give the native
engine's samples; sampled, the rounds repeat exactly; and a GRPO run with partial rollout on vLLM
equals the native engine's, every sync proven."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from posttrain.loops.partial_rollout import PartialRollout
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine
from tests.helpers.runs import metrics_by_iteration, world_run_config

GREEDY = SamplingParams(temperature=0.0, top_k=-1, max_tokens=9)


@pytest.fixture(scope="module")
def model(tiny_tokenizer):
    """A random Qwen2 whose greedy outputs vary (weights spread wider than HF's default)."""
    from tests.helpers.vllm_models import vllm_qwen2

    return vllm_qwen2(len(tiny_tokenizer), tied=False, initializer_range=0.1)


@pytest.fixture(scope="module")
def vllm(model):
    from posttrain.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(copy.deepcopy(model), eos_token_ids=[], dtype="float32", max_model_len=256, max_num_seqs=16,
                      max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = ["hello there", "7 * 8 = ?", "three", "the sum of 12 and 30", "abc", "zebra", "one two", "x + y"]
    return [tiny_tokenizer.encode(f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n",
                                  add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def stop(model, prompts) -> int:
    """A token the greedy model writes early in some responses but not in others, so samples finish
    in different rounds and some wait, unfinished, for the next iteration's weights."""
    outs = NativeEngine(model, pad_token_id=0, eos_token_ids=[]).generate(prompts, 1, GREEDY)
    firsts = [set(group[0].token_ids[1:5]) for group in outs]
    counts = Counter(t for s in firsts for t in s)
    return next(t for t, c in counts.most_common() if c < len(prompts))


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2 * p.std().clamp_min(1e-3))


def partial_run(model, engine_of, prompts, stop: int, sampling: SamplingParams, iterations: int = 3):
    """Three iterations of partial rollout (2 groups of 2 per update, split 3 of 9 tokens), the
    weights perturbed (and synced) after each: the samples each update takes, and the dock's metrics."""
    model = copy.deepcopy(model)
    engine = engine_of(model)
    pool = PartialRollout(n=2, global_batch_size=2, max_split=3, max_tokens=sampling.max_tokens, max_model_len=None)
    batches, metrics, start = [], [], 0
    for it in range(iterations):
        while len(pool.free_groups()) >= 2:
            pool.add_prompts(prompts[start:start + 2], [torch.zeros(0)] * 2)
            start += 2
        pool.fill(engine, sampling, [stop], version=it)
        batch, m = pool.take()
        batches.append(batch)
        metrics.append(m)
        perturb(model, seed=it)
        engine.sync_weights(model)
    return batches, metrics


def native_rounds(model):
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=[])
    engine.supports_rounds = False  # round by round, as the vLLM engine is driven
    return engine


def synced(vllm):
    def engine_of(model):
        vllm.sync_weights(model)
        return vllm
    return engine_of


def test_greedy_partial_rollout_is_the_native_engines(model, vllm, prompts, stop):
    want, want_metrics = partial_run(model, native_rounds, prompts, stop, GREEDY)
    got, got_metrics = partial_run(model, synced(vllm), prompts, stop, GREEDY)
    assert max(m["rollout/age_max"] for m in want_metrics) >= 1  # some samples were continued after a sync
    assert got_metrics == want_metrics
    for g, w in zip(got, want):
        assert [r.tolist() for r in g["responses"]] == [r.tolist() for r in w["responses"]]
        assert [int(v) for v in g["policy_version"]] == [int(v) for v in w["policy_version"]]
        for a, b in zip(g["rollout_logprobs"], w["rollout_logprobs"]):
            assert a.tolist() == pytest.approx(b.tolist(), abs=1e-4)
    assert vllm.pop_metrics()["rollout/sync_probe_diff"] < 1e-4


def test_sampled_partial_rollout_repeats_exactly(model, vllm, prompts, stop):
    """Seeded by (seed, group, sample, position), a continued request draws the same tokens again."""
    sampling = SamplingParams(temperature=1.0, top_k=-1, max_tokens=9, seed=3)
    first, _ = partial_run(model, synced(vllm), prompts, stop, sampling)
    second, _ = partial_run(model, synced(vllm), prompts, stop, sampling)
    for a, b in zip(first, second):
        assert [r.tolist() for r in a["responses"]] == [r.tolist() for r in b["responses"]]
    lengths = [r.numel() for batch in first for r in batch["responses"]]
    assert max(lengths) > 3  # beyond one round's 3 tokens: continued requests


def test_a_greedy_grpo_run_with_partial_rollout_equals_the_native_engines(vllm_world, tmp_path, one_thread):
    from posttrain.commands.train import train_config as train

    runs = {}
    for engine in ("vllm", "native"):
        path = tmp_path / engine
        train(world_run_config(vllm_world, path, iters=3, rl_config={"rollout_engine": engine,
                                                                     "partial_rollout_max_split": 2},
                               generate_config={"max_num_seqs": 16, "sampling_config": {
                                   "max_tokens": 4, "temperature": 0.0, "top_k": -1, "top_p": 1.0}}))
        runs[engine] = metrics_by_iteration(path / "out")
    vllm, native = runs["vllm"], runs["native"]
    assert sorted(vllm) == [1, 2, 3]
    for it in (1, 2, 3):
        assert vllm[it]["rollout/sync_probe_diff"] < 1e-4
        for key, value in native[it].items():
            # the native engine runs an iteration's rounds as one decode that stops at the first ready
            # check, so its rounds and unfinished counts differ; the samples trained on do not
            if isinstance(value, (int, float)) and not key.startswith(("timing/", "rollout/rounds",
                                                                        "rollout/unfinished")) \
                    and not key.endswith("_tps") and key not in ("time",):
                assert vllm[it][key] == pytest.approx(value, abs=1e-3, rel=1e-3), (it, key)
