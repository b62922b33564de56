"""vLLM adapter: same interface and same greedy tokens as the native engine (CUDA + vllm only)."""

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
                             gpu_memory_utilization=0.2)
    native = NativeEngine(model, pad_token_id=0, eos_token_ids=[])
    got, want = vllm_engine.generate(prompts, 2, greedy), native.generate(prompts, 2, greedy)
    assert [[o.token_ids for o in g] for g in got] == [[o.token_ids for o in g] for g in want]
    assert all(len(o.logprobs) == len(o.token_ids) == 8 and o.finish_reason == "length" for g in got for o in g)
