"""The native engine on a real (tiny, random-init) Hugging Face Qwen2: logprobs, shared prefill, colocation."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.base import ROLLOUT_ENGINES, SamplingParams
from posttrain.rollout.native import NativeEngine

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # unequal: left padding is exercised


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).float()


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


def test_bfloat16_autocast_keeps_fp32_weights(model):
    eng = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype="bfloat16")
    out = eng.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_tokens=6, seed=0))
    assert all(p.dtype == torch.float32 for p in model.parameters())
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
