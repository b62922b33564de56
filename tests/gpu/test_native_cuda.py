"""The native engine on a real GPU (run by benchmarks/gpu/device_check.sh, skipped elsewhere).

bf16 weights and KV cache (the engine's bf16 copy of the fp32 actor), the static-cache decode with
and without CUDA graphs: greedy tokens equal Hugging Face ``generate`` on the same bf16 weights, and
the returned log-probs match a teacher-forced forward of those weights within bf16 tolerance."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


@pytest.fixture(scope="module")
def actor():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    # a wide init gives peaked next-token distributions, so bf16 rounding does not flip the argmax
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).float().cuda()


def hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("graphs", [False, True])
def test_bf16_static_decode_greedy_equals_hf_generate(actor, graphs):
    engine = NativeEngine(actor, pad_token_id=0, eos_token_ids=[], dtype="bfloat16", cuda_graphs=graphs)
    assert engine.static_cache and engine.sampling_copy
    got = engine.generate(PROMPTS, 2, SamplingParams(temperature=0, max_tokens=24))
    bf16 = copy.deepcopy(actor).to(torch.bfloat16)
    assert next(engine._copy.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in actor.parameters())
    for prompt, group in zip(PROMPTS, got):
        want = hf_greedy(bf16, prompt, 24)
        assert all(o.token_ids == want for o in group)
        ids = torch.tensor([prompt + want], device="cuda")
        with torch.no_grad():
            logits = bf16(ids).logits[0, len(prompt) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(want, device="cuda")[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(group[0].logprobs, device="cuda"), ref, atol=0.05)


def test_cuda_graph_decode_follows_the_optimizer(actor):
    """A second call after an optimizer step samples from the new weights (the graph replays on the
    refreshed bf16 copy's buffers)."""
    model = copy.deepcopy(actor)
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype="bfloat16", cuda_graphs=True)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    engine.generate(PROMPTS, 1, greedy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    batch = torch.tensor([[1, 2, 3, 4, 5, 6]], device="cuda")
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    after = engine.generate(PROMPTS, 1, greedy)
    fresh = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype="bfloat16").generate(PROMPTS, 1, greedy)
    assert [o.token_ids for g in after for o in g] == [o.token_ids for g in fresh for o in g]
