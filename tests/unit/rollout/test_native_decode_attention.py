"""The rollout's one-token queries on a CPU (``posttrain.models.cpu_attention.decode_sdpa``): without a
mask they run their GQA as ``pack_gqa`` (transformers' path with a mask), not ``enable_gqa``, whose
bf16 CPU kernel is several times slower; the result equals transformers' SDPA attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from posttrain.models import cpu_attention
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine
from posttrain.training import remove_padding

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12]]  # one length: the decode's batch needs no mask


class _Module(torch.nn.Module):
    num_key_value_groups = 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_token_query_without_a_mask_equals_transformers_sdpa(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 9, 1, 16, generator=g).to(dtype)
    k, v = (torch.randn(5, 3, 11, 16, generator=g).to(dtype) for _ in range(2))
    mine, _ = cpu_attention.decode_sdpa(_Module(), q, k, v, None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(_Module(), q, k, v, None, scaling=0.25)
    assert mine.shape == theirs.shape == (5, 1, 9, 16)
    exact, _ = sdpa_attention_forward(_Module(), q.float(), k.float(), v.float(), None, scaling=0.25)
    assert torch.allclose(mine.float(), exact, atol=1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.allclose(mine.float(), theirs.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)


def _decode_calls(model, monkeypatch, setting: str):
    """A bf16 rollout under ``$POSTTRAIN_CPU_ATTENTION=setting``: the engine, its outputs, and the
    (query shape, enable_gqa) of every one-token SDPA call."""
    monkeypatch.setenv(cpu_attention.ENV, setting)
    calls, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        if q.shape[2] <= 3 and k.shape[2] > 4:  # the decode's steps (the prefill's queries are the prompt)
            calls.append((tuple(q.shape), kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype="bfloat16")
    outs = engine.generate(PROMPTS, 3, SamplingParams(temperature=0.0, max_tokens=6))
    return engine, outs, calls


def test_the_sampling_copy_decodes_with_pack_gqa_and_off_restores_enable_gqa(model, monkeypatch):
    engine, outs, calls = _decode_calls(model, monkeypatch, "on")
    assert engine._copy.config._attn_implementation == cpu_attention.DECODE_SDPA
    assert calls and all(shape == (6, 2, 2, 16) and not gqa for shape, gqa in calls)  # 4 heads, 2 kv heads of 16
    _, outs_off, calls_off = _decode_calls(copy.deepcopy(model), monkeypatch, "off")
    assert calls_off and all(shape == (6, 4, 1, 16) and gqa for shape, gqa in calls_off)
    for group, group_off in zip(outs, outs_off):
        for out, out_off in zip(group, group_off):
            assert out.token_ids == out_off.token_ids
            assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(out_off.logprobs), atol=2e-2)


def test_a_first_rollout_computes_as_the_rollouts_after_the_packed_attention_is_installed(model, monkeypatch):
    """A process's first rollout runs before training installs the packed attention (whose unpacked
    forwards call decode_sdpa): the engine switches the model it samples from when it is built, so both
    compute alike and a resumed run repeats the straight one bit for bit."""
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    actor = copy.deepcopy(model)
    actor.config._attn_implementation = "sdpa"
    engine = NativeEngine(actor, pad_token_id=0, eos_token_ids=[])  # fp32: the actor samples itself
    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    first = engine.generate(PROMPTS, 3, sampling)
    assert actor.config._attn_implementation == cpu_attention.DECODE_SDPA
    remove_padding.enable(actor)
    assert actor.config._attn_implementation == remove_padding.ATTN_NAME
    again = engine.generate(PROMPTS, 3, sampling)
    assert [o.logprobs for g in first for o in g] == [o.logprobs for g in again for o in g]
