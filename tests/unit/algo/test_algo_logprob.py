"""Log-probs and entropy from logits against the plain log_softmax reference."""

import math

import torch

from posttrain.algo.logprob import entropy_from_logits, logprobs_from_logits


def _reference(logits, labels, temperature):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, labels[..., None]).squeeze(-1)


def test_logprobs_match_log_softmax_with_temperature_and_chunks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    labels = torch.randint(0, 11, (3, 5), generator=g)
    for temperature in (1.0, 0.7):
        ref = _reference(logits, labels, temperature)
        assert torch.allclose(logprobs_from_logits(logits, labels, temperature), ref, atol=1e-6)
        chunked = logprobs_from_logits(logits, labels, temperature, chunk_tokens=4)
        assert torch.allclose(chunked, ref, atol=1e-6)


def test_logprobs_hand_value_and_gradient():
    logits = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)  # probs 1/4, 3/4
    out = logprobs_from_logits(logits, torch.tensor([[1]]))
    assert math.isclose(out.item(), math.log(0.75), rel_tol=1e-6)
    out.sum().backward()
    # d log p_1 / dz = onehot(1) - softmax
    assert torch.allclose(logits.grad, torch.tensor([[[-0.25, 0.25]]]), atol=1e-6)


def test_bf16_logits_give_float32():
    logits = torch.randn(2, 3, 7).bfloat16()
    labels = torch.zeros(2, 3, dtype=torch.long)
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    assert torch.allclose(out, _reference(logits, labels, 1.0), atol=1e-6)


def test_entropy_values():
    uniform = torch.zeros(1, 2, 8)
    assert torch.allclose(entropy_from_logits(uniform), torch.full((1, 2), math.log(8)), atol=1e-6)
    logits = torch.randn(2, 3, 5)
    p = torch.softmax(logits / 0.5, -1)
    ref = -(p * p.log()).sum(-1)
    assert torch.allclose(entropy_from_logits(logits, 0.5, chunk_tokens=2), ref, atol=1e-5)
