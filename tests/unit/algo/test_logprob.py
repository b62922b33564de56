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


def test_scaled_logprobs_and_entropy_match_the_formulas_and_their_gradient():
    """The fused log-prob (its backward reuses the forward's softmax) against the reference
    formulas, and its gradient against finite differences (gradcheck, float64)."""
    from posttrain.algo.logprob import scaled_logprobs_and_entropy

    torch.manual_seed(0)
    z = (torch.randn(5, 40, dtype=torch.float64) * 4).requires_grad_(True)
    labels = torch.randint(0, 40, (5,))
    lp, ent = scaled_logprobs_and_entropy(z, labels, with_entropy=True, entropy_grad=False)
    assert not ent.requires_grad
    logp = torch.log_softmax(z, dim=-1)  # the plain reference, in float64
    assert torch.allclose(lp, logp.gather(-1, labels[:, None]).squeeze(-1), atol=1e-12)
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1), atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: scaled_logprobs_and_entropy(x, labels, with_entropy=False)[0], (z,))
    with torch.no_grad():  # no graph: the plain formulas
        assert torch.allclose(scaled_logprobs_and_entropy(z, labels)[0], lp, atol=1e-12)
