"""vLLM adapter: same interface and same greedy tokens as the native engine, also after the actor's
weights change (CUDA + vllm only; tests/unit/rollout/test_vllm_fake.py checks the calls on a CPU)."""

from __future__ import annotations

import pytest
import torch

from posttrain.rollout.base import SamplingParams

pytestmark = pytest.mark.gpu


def test_vllm_engine_matches_native_greedy():
    pytest.importorskip("vllm")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.rollout.native import NativeEngine
    from posttrain.rollout.vllm_engine import VLLMEngine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = Qwen2ForCausalLM(cfg).cuda()
    prompts = [[5, 6, 7, 8], [9, 10]]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    vllm_engine = VLLMEngine(model, eos_token_ids=[], dtype="float32", max_model_len=256,
                             gpu_memory_utilization=0.2, sleep_mode=False)  # vLLM: one sleep-mode LLM per process
    native = NativeEngine(model, pad_token_id=0, eos_token_ids=[])
    got, want = vllm_engine.generate(prompts, 2, greedy), native.generate(prompts, 2, greedy)
    assert [[o.token_ids for o in g] for g in got] == [[o.token_ids for o in g] for g in want]
    assert all(len(o.logprobs) == len(o.token_ids) == 8 and o.finish_reason == "length" for g in got for o in g)


def test_vllm_engine_follows_the_actor_after_sync_and_sleep():
    """After the actor's weights change, ``sync_weights`` (through sleep and wake) makes vLLM's greedy
    tokens and log-probs the native engine's on the new weights."""
    pytest.importorskip("vllm")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.rollout.native import NativeEngine
    from posttrain.rollout.vllm_engine import VLLMEngine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).cuda()
    prompts = [[5, 6, 7, 8], [9, 10]]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    engine = VLLMEngine(model, eos_token_ids=[], dtype="float32", max_model_len=256, gpu_memory_utilization=0.2)
    native = NativeEngine(model, pad_token_id=0, eos_token_ids=[])
    engine.generate(prompts, 1, greedy)  # then asleep
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.sync_weights(model)
    got, want = engine.generate(prompts, 1, greedy), native.generate(prompts, 1, greedy)
    assert [[o.token_ids for o in g] for g in got] == [[o.token_ids for o in g] for g in want]
    for g, w in zip(got, want):
        assert g[0].logprobs == pytest.approx(w[0].logprobs, abs=1e-3)
