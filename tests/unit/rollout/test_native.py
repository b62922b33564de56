"""The native engine on a real (tiny, random-init) Hugging Face Qwen2: logprobs, shared prefill, colocation."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.base import ROLLOUT_ENGINES, SamplingParams
from posttrain.errors import DataError
from posttrain.rollout.native import NativeEngine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # unequal: left padding is exercised


def teacher_forced(model, prompt, response, temperature):
    """Reference: log_softmax(logits / T) of the whole sequence, gathered at the response tokens."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logits = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def tokens(outs):
    return [o.token_ids for group in outs for o in group]


def test_logprobs_match_teacher_forced_forward(model):
    # many stop ids, so rows finish at different steps and the batch is compacted mid-decode
    eng = NativeEngine(model, pad_token_id=0, eos_token_ids=list(range(80, 96)), compact_fraction=0.01)
    outs = eng.generate(PROMPTS, 4, SamplingParams(temperature=0.7, top_k=-1, max_tokens=16, seed=0))
    lengths = {len(o.token_ids) for g in outs for o in g}
    assert len(lengths) > 1, "test needs samples of mixed lengths"
    for prompt, group in zip(PROMPTS, outs):
        for out in group:
            assert len(out.logprobs) == len(out.token_ids)
            ref = teacher_forced(model, prompt, out.token_ids, 0.7)
            assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4)
            assert (out.finish_reason == "stop") == (out.token_ids[-1] >= 80)


def test_shared_prefill_equals_separate_prompts_greedy(model):
    eng = NativeEngine(model, pad_token_id=0, eos_token_ids=[])
    greedy = SamplingParams(temperature=0, max_tokens=12)
    shared = eng.generate(PROMPTS, 3, greedy)
    separate = eng.generate([p for p in PROMPTS for _ in range(3)], 1, greedy)
    assert tokens(shared) == tokens(separate)
    for prompt, group in zip(PROMPTS, shared):  # and equal to HF's own greedy decoding
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(prompt):].tolist()
        assert all(o.token_ids == hf for o in group)


def test_small_batch_limits_give_the_same_greedy_tokens(model):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    big = NativeEngine(model, pad_token_id=0, eos_token_ids=[]).generate(PROMPTS, 3, greedy)
    small = ROLLOUT_ENGINES.get("native")(model=model, pad_token_id=0, eos_token_ids=[], max_num_seqs=2,
                                          max_num_batched_tokens=4).generate(PROMPTS, 3, greedy)
    assert tokens(big) == tokens(small)


def test_seeded_sampling_is_deterministic(model):
    eng = NativeEngine(model, pad_token_id=0, eos_token_ids=[])
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=123)
    assert tokens(eng.generate(PROMPTS, 2, sp)) == tokens(eng.generate(PROMPTS, 2, sp))


def test_colocated_engine_sees_the_optimizer_step(model):
    import copy

    actor = copy.deepcopy(model)
    eng = NativeEngine(actor, pad_token_id=0, eos_token_ids=[])
    assert eng.model is actor
    greedy = SamplingParams(temperature=0, max_tokens=6)
    before = eng.generate(PROMPTS[:1], 1, greedy)[0][0]
    # one SGD step that pushes the first greedy token down hard
    actor.train()
    opt = torch.optim.SGD(actor.parameters(), lr=5.0)
    logits = actor(torch.tensor([PROMPTS[0]])).logits[0, -1]
    torch.log_softmax(logits, -1)[before.token_ids[0]].backward()
    opt.step()
    after = eng.generate(PROMPTS[:1], 1, greedy)[0][0]
    assert actor.training
    assert after.token_ids != before.token_ids
    ref = teacher_forced(actor, PROMPTS[0], after.token_ids, 0)
    assert torch.allclose(torch.tensor(after.logprobs), ref, atol=1e-4)


@pytest.mark.parametrize("sampling_copy", [None, False], ids=["bf16-copy-default", "autocast"])
def test_bfloat16_rollout_keeps_fp32_weights(model, sampling_copy):
    eng = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype="bfloat16", sampling_copy=sampling_copy)
    assert eng.sampling_copy is (sampling_copy is None)  # a bf16 rollout samples from a bf16 copy on a CPU too
    out = eng.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=6, seed=0))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (eng._copy is not None) is (sampling_copy is None)
    for prompt, group in zip(PROMPTS, out):
        ref = teacher_forced(model, prompt, group[0].token_ids, 1.0)
        assert torch.allclose(torch.tensor(group[0].logprobs), ref, atol=0.1)  # bf16 rounding only


def test_keyed_samples_on_a_real_model_do_not_depend_on_the_batch(model):
    """Prompts sampled together, one per call (their keys passed) or in waves of 2 rows give the
    same tokens: the per-row logits agree across batch shapes far below the draws' resolution."""
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, max_tokens=10, seed=4)
    together = tokens(NativeEngine(model, pad_token_id=0, eos_token_ids=list(range(88, 96))).generate(PROMPTS, 3, sp))
    eng = NativeEngine(model, pad_token_id=0, eos_token_ids=list(range(88, 96)), max_num_seqs=2)
    alone = [t for i, p in enumerate(PROMPTS) for t in tokens(eng.generate([p], 3, sp, prompt_keys=[i]))]
    assert alone == together
    assert len({tuple(t) for t in together}) > 6  # the samples really are random


def test_static_cache_decode_equals_dynamic(model):
    """The fixed-shape decode (StaticCache, no compaction: the CUDA-graph path with compile off)
    samples the same tokens with the same log-probs as the compacting dynamic decode (fp32, CPU)."""
    stops = list(range(80, 96))
    sp = SamplingParams(temperature=0.8, top_k=-1, max_tokens=20, seed=3)
    dynamic = NativeEngine(model, pad_token_id=0, eos_token_ids=stops, compact_fraction=0.01)
    static = NativeEngine(model, pad_token_id=0, eos_token_ids=stops, static_cache=True)
    want, got = dynamic.generate(PROMPTS, 4, sp), static.generate(PROMPTS, 4, sp)
    assert len({len(t) for t in tokens(want)}) > 1, "test needs rows that finish at different steps"
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert a.finish_reason == b.finish_reason
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    capped = static.generate(PROMPTS, 2, sp, max_new_tokens=[3, 20, 5])  # per-row caps on the static path too
    assert tokens(capped) == tokens(dynamic.generate(PROMPTS, 2, sp, max_new_tokens=[3, 20, 5]))


def small_fp32_actor():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).float()


def test_bf16_sampling_copy_follows_every_optimizer_step():
    """``sampling_copy`` samples from a bf16 copy of the fp32 actor; after each optimizer step
    (fused AdamW too, which bumps no version counter) it samples what a fresh copy samples, also
    when its weights were freed for the update (``drop_sampling_weights``, as a synchronous loop does)."""
    actor = small_fp32_actor()
    greedy = SamplingParams(temperature=0, max_tokens=10)
    engine = NativeEngine(actor, pad_token_id=0, eos_token_ids=[], dtype="bfloat16", sampling_copy=True)
    before = engine.generate(PROMPTS, 1, greedy)
    changed = []
    for fused in (False, True):
        if fused:
            engine.drop_sampling_weights()
        optimizer = torch.optim.AdamW(actor.parameters(), lr=0.05, fused=fused)
        batch = torch.tensor([[1, 2, 3, 4, 5, 6]])
        actor(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = engine.generate(PROMPTS, 1, greedy)
        fresh = NativeEngine(actor, pad_token_id=0, eos_token_ids=[], dtype="bfloat16", sampling_copy=True)
        assert tokens(after) == tokens(fresh.generate(PROMPTS, 1, greedy))
        for mine, theirs in zip(engine._copy.parameters(), actor.parameters()):
            assert torch.equal(mine, theirs.to(torch.bfloat16))
        changed.append(tokens(after) != tokens(before))
        before = after
    assert any(changed), "the steps should change what is sampled"
    assert all(p.dtype == torch.float32 for p in actor.parameters())


def test_freed_sampling_weights_come_back_at_the_next_call():
    """``drop_sampling_weights`` frees the bf16 copy's weights (and the packs); the next call samples
    as before from the refreshed copy, though no optimizer step moved the actor's version."""
    from posttrain.models import packed_linear

    actor = small_fp32_actor()
    greedy = SamplingParams(temperature=0, max_tokens=10)
    packed = packed_linear.available()
    engine = NativeEngine(actor, pad_token_id=0, eos_token_ids=[], dtype="bfloat16", sampling_copy=True,
                          packed_weights=packed)
    first = engine.generate(PROMPTS, 2, greedy)
    packs = len(engine._packs.packs) + len(engine._packs.fused)
    assert (packs > 0) == packed
    assert engine.drop_sampling_weights() == packs + len(list(actor.parameters()))
    assert all(p.numel() == 0 for p in engine._copy.parameters()) and not engine._packs.packs
    assert tokens(engine.generate(PROMPTS, 2, greedy)) == tokens(first)
    for mine, theirs in zip(engine._copy.parameters(), actor.parameters()):
        assert torch.equal(mine, theirs.to(torch.bfloat16))
    assert engine.drop_sampling_weights() == packs + len(list(actor.parameters()))  # made again, freed again


def test_cuda_graphs_need_cuda(model):
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="enforce_eager"):
        NativeEngine(model, pad_token_id=0, eos_token_ids=[], cuda_graphs=True)


def test_out_of_memory_names_the_keys_that_size_the_rollout(model, monkeypatch):
    eng = NativeEngine(model, pad_token_id=0, eos_token_ids=[])

    def boom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(eng, "_run_wave", boom)
    with pytest.raises(torch.OutOfMemoryError, match="max_num_seqs.*gpu_memory_utilization"):
        eng.generate(PROMPTS, 2, SamplingParams(max_tokens=4, seed=0))


def test_max_model_len_stops_each_response_at_its_room(model):
    """A prompt and its response hold at most ``max_model_len`` tokens (as vLLM cuts them): each
    sample of a prompt of length L stops after ``max_model_len - L`` tokens with finish reason
    "length", its tokens the first ones of the uncapped engine's keyed sample; a prompt without
    room is refused."""
    sp = SamplingParams(temperature=1.0, top_k=-1, max_tokens=12, seed=5)
    free = NativeEngine(model, pad_token_id=0, eos_token_ids=[]).generate(PROMPTS, 2, sp)
    limit = min(len(p) for p in PROMPTS) + 7
    capped = NativeEngine(model, pad_token_id=0, eos_token_ids=[], max_model_len=limit).generate(PROMPTS, 2, sp)
    rooms = {limit - len(p) for p in PROMPTS}
    assert len(rooms) > 1, "test needs prompts of different lengths"
    for prompt, mine, theirs in zip(PROMPTS, capped, free):
        for a, b in zip(mine, theirs):
            assert len(a.token_ids) == min(12, limit - len(prompt)) and a.finish_reason == "length"
            assert a.token_ids == b.token_ids[:len(a.token_ids)]
    with pytest.raises(DataError, match="max_model_len=3"):
        NativeEngine(model, pad_token_id=0, eos_token_ids=[], max_model_len=3).generate(PROMPTS, 1, sp)


SYSTEM = list(range(30, 50))  # a 20-token prefix every prompt starts with (a system prompt)


def test_common_prefix_is_prefilled_once_and_samples_as_without(model, monkeypatch):
    """Prompts that start alike: the prefix runs once (one row of 20 tokens, then each prompt's rest),
    and the samples and their log-probs are those of a prefill of whole prompts."""
    from posttrain.rollout import scheduling

    prompts = [SYSTEM + p for p in PROMPTS]
    assert scheduling.shared_prefix(prompts) == 20
    sp = SamplingParams(temperature=0.8, top_k=-1, max_tokens=12, seed=5)
    eng = NativeEngine(model, pad_token_id=0, eos_token_ids=list(range(80, 96)))
    fed = []
    forward = eng._forward
    monkeypatch.setattr(eng, "_forward", lambda ids, *a, **k: fed.append(tuple(ids.shape)) or forward(ids, *a, **k))
    shared = eng.generate(prompts, 3, sp)
    assert fed[:2] == [(1, 20), (3, 7)]  # the prefix once, then the rests (the longest 7 tokens)
    monkeypatch.setattr(scheduling, "MIN_SHARED_PREFIX", 10**6)
    calls = len(fed)
    whole = eng.generate(prompts, 3, sp)
    assert fed[calls] == (3, 27) and tokens(shared) == tokens(whole)  # whole prompts: the longest 27 tokens
    assert len({tuple(t) for t in tokens(shared)}) > 6  # the samples really are random
    for prompt, got, want in zip(prompts, shared, whole):
        for a, b in zip(got, want):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
            assert torch.allclose(torch.tensor(a.logprobs), teacher_forced(model, prompt, a.token_ids, 0.8), atol=1e-4)


@pytest.mark.parametrize("prompts, want", [
    ([SYSTEM + [1], SYSTEM + [2, 3]], 20),
    ([SYSTEM, SYSTEM + [2, 3]], 19),  # every prompt keeps a token of its own
    ([SYSTEM + [1], SYSTEM[:10] + [2]], 0),  # 10 tokens in common: below MIN_SHARED_PREFIX
    ([SYSTEM + [1], [7] + SYSTEM], 0),
])
def test_shared_prefix_length(prompts, want):
    from posttrain.rollout.scheduling import shared_prefix

    assert shared_prefix(prompts) == want


def test_static_cache_decode_after_a_shared_prefill_equals_dynamic(model):
    """The static cache (CUDA's default) copies a prefill whose columns are [prefix][padding][rest]."""
    prompts = [SYSTEM + p for p in PROMPTS]
    sp = SamplingParams(temperature=0.8, top_k=-1, max_tokens=10, seed=6)
    stops = list(range(80, 96))
    dynamic = NativeEngine(model, pad_token_id=0, eos_token_ids=stops).generate(prompts, 2, sp)
    static = NativeEngine(model, pad_token_id=0, eos_token_ids=stops, static_cache=True).generate(prompts, 2, sp)
    assert tokens(static) == tokens(dynamic)
    for g, w in zip(static, dynamic):
        for a, b in zip(g, w):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
