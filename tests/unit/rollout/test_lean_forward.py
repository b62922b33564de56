"""The rollout's lean Llama-family forward (``models.lean_forward``) equals the model's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from posttrain.models import lean_forward
from posttrain.models.packed_linear import PackedLinears
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.kv_cache import new_cache
from posttrain.rollout.native import NativeEngine

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":  # biases in the MLP: the stacked gate/up bias
        return LlamaForCausalLM(LlamaConfig(**COMMON, mlp_bias=True)).eval()
    if kind == "qwen3":  # query/key head norms (weights off 1: each head's own weight must apply)
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.add_(0.5 * torch.randn(norm.weight.shape))
        return model
    return Qwen2ForCausalLM(Qwen2Config(**COMMON)).eval()  # biases in q/k/v


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_forward_equals_the_model_with_a_cache_and_padding(kind):
    model = _model(kind)
    packs = PackedLinears()
    packs.refresh(model, 0, lean_forward.fused_groups(model))
    assert len(packs.fused) == 4 * COMMON["num_hidden_layers"] and model.model.layers[0].self_attn.q_proj not in packs.packs
    layers = lean_forward.plan(model, packs.fused)
    ids = torch.randint(1, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :2] = 0  # row 0 left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = new_cache(model, 16)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        with packs.installed():  # a prefill of 4 columns, 3 fed at once (speculation), then 1 (decode)
            parts = [lean_forward.forward(model, layers, ids[:, a:b], mask[:, :b], positions[:, a:b], cache, b - a)
                     for a, b in ((0, 4), (4, 7), (7, 8))]
    got = torch.cat(parts, 1)
    real = mask.bool()
    assert torch.allclose(got[real], ref[real], atol=1e-5)


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("qwen2", torch.float32), ("llama", torch.bfloat16),
                                        ("qwen3", torch.float32), ("qwen3", torch.bfloat16)])
def test_engine_samples_as_with_the_model_forward(kind, dtype, monkeypatch):
    """Same tokens and log-probs with the lean forward as with the model's own (packed weights both,
    fp32 or a bf16 model); ``$POSTTRAIN_LEAN_FORWARD=off`` restores the model's forward."""
    model = _model(kind)
    with torch.no_grad():  # norm weights off 1, where rounding before or after them differs
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    model = model.to(dtype)
    sp = SamplingParams(temperature=0.8, top_k=-1, max_tokens=12, seed=2)
    shapes = []
    real = lean_forward.forward
    monkeypatch.setattr(lean_forward, "forward", lambda *a, **k: shapes.append(tuple(a[2].shape)) or real(*a, **k))
    engine = dict(pad_token_id=0, eos_token_ids=list(range(80, 96)), packed_weights=True, compact_fraction=0.01)
    lean = NativeEngine(model, **engine)
    got = lean.generate(PROMPTS, 3, sp)
    assert lean.use_lean_forward and shapes[0] == (3, 7) and shapes[1][1] == 1  # the prefill and the decode
    monkeypatch.setenv(lean_forward.ENV, "off")
    plain = NativeEngine(model, **engine)
    calls = len(shapes)
    want = plain.generate(PROMPTS, 3, sp)
    assert not plain.use_lean_forward and len(shapes) == calls
    assert len({len(o.token_ids) for g in want for o in g}) > 1, "test needs rows that finish at different steps"
    assert [o.token_ids for g in got for o in g] == [o.token_ids for g in want for o in g]
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_supported_models():
    assert all(lean_forward.supported(_model(kind)) for kind in ("llama", "qwen2", "qwen3"))
    odd = _model("qwen3")
    odd.model.layers[1].self_attn.k_norm.variance_epsilon = 1e-3  # one epsilon for both norms, or not lean
    assert not lean_forward.supported(odd)
    sliding = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=4))
    assert not lean_forward.supported(sliding)  # another model type (and a sliding window)
    tp = LlamaForCausalLM(LlamaConfig(**COMMON, pretraining_tp=2))
    assert not lean_forward.supported(tp)


def test_the_lean_pieces_compute_transformers_numbers_bitwise():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 12, 2, 64, generator=gen)
    cos, sin = torch.randn(3, 1, 2, 64, generator=gen), torch.randn(3, 1, 2, 64, generator=gen)
    assert torch.equal(lean_forward._rotary(cos, sin)(x), x * cos + rotate_half(x) * sin)
    norm = LlamaRMSNorm(64, eps=1e-5)
    norm.weight.data = torch.randn(64, generator=gen)
    hidden = 3 * torch.randn(3, 2, 64, generator=gen)
    assert torch.equal(lean_forward._norm(norm)(hidden), norm(hidden))
    assert torch.equal(lean_forward._norm(norm.to(torch.bfloat16))(hidden.bfloat16()),
                       norm.to(torch.bfloat16)(hidden.bfloat16()))  # bf16: the module itself
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0
    q, k, v = (torch.randn(3, 4, queries, 8, generator=gen) for queries in (2, 9, 9))
    boolean = torch.ones(2, 9, dtype=torch.bool).tril(7)[None, None] & mask.bool()[:, None, None, :]
    additive = lean_forward._attention_mask(mask, 2, torch.float32)
    assert additive.dtype == torch.float32 and bool(additive[0, 0, 0, :3].isinf().all())
    assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive),
                       torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=boolean))
    assert lean_forward._attention_mask(torch.ones(3, 9, dtype=torch.long), 1, torch.float32) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_head_norm_computes_the_modules_numbers_bitwise(dtype):
    attn = _model("qwen3").to(dtype).model.layers[0].self_attn  # 4 query heads, 2 key heads of 16
    heads = 3 * torch.randn(3, 5, 6, 16, generator=torch.Generator().manual_seed(3)).to(dtype)  # [B, Q, heads, D]
    want = torch.cat([attn.q_norm(heads[:, :, :4]), attn.k_norm(heads[:, :, 4:])], dim=2)
    assert torch.equal(lean_forward._head_norm(attn)(heads), want)
