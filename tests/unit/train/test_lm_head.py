"""Chunked log-probs through the LM head (posttrain.training.lm_head) equal the full computation."""

from __future__ import annotations

import pytest
import torch

from posttrain.algo.logprob import entropy_from_logits, logprobs_from_logits
from posttrain.training import lm_head
from posttrain.training.forward import response_logprobs
from posttrain.training.lm_head import detached_head, head_logprobs


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_chunked_head_logprobs_entropies_and_gradients_equal_the_full_logits(recompute, bias, monkeypatch):
    """Kept logits and checkpointed (recomputed in the backward pass) chunks alike, with or without
    a bias in the head."""
    monkeypatch.setattr(lm_head, "RECOMPUTE_ABOVE", 0 if recompute else 1 << 28)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 7))
    weights = torch.randn(3, 7)  # a per-token upstream gradient, as the policy loss sends

    def full():
        logits = head(hidden)
        return logprobs_from_logits(logits, labels, 0.7), entropy_from_logits(logits, 0.7)

    for entropy_grad in (False, True):
        want_lp, want_ent = full()
        ((want_lp * weights).sum() + (want_ent.sum() if entropy_grad else 0)).backward()
        want_grads = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
        hidden.grad = None
        head.zero_grad(set_to_none=True)
        lp, ent = head_logprobs(head, hidden, labels, 0.7, with_entropy=True, entropy_grad=entropy_grad,
                                chunk_tokens=4)  # 21 tokens: 6 chunks, the last one short
        assert ent.requires_grad == entropy_grad
        ((lp * weights).sum() + (ent.sum() if entropy_grad else 0)).backward()
        assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(ent, want_ent, atol=1e-6)
        for got, want in zip([hidden.grad] + [p.grad for p in head.parameters()], want_grads):
            assert torch.allclose(got, want, atol=1e-6)
        hidden.grad = None
        head.zero_grad(set_to_none=True)


@pytest.mark.parametrize("tied", [True, False])
def test_response_logprobs_through_the_detached_head_equal_the_models_logits(tied, monkeypatch):
    """A tiny Qwen2: the log-probs, entropies and every parameter's gradient equal those from the
    model's own full logits; the head is back in place afterwards (the tie kept)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
    ids = torch.randint(1, 64, (2, 9))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "response_mask": torch.tensor([[1.0] * 4, [1.0, 1.0, 1.0, 0.0]])}
    head = model.lm_head
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 3 * 64)  # 3 tokens a chunk
    monkeypatch.setattr(lm_head, "RECOMPUTE_ABOVE", 0)  # checkpointed chunks
    lp, ent = response_logprobs(model, batch, temperature=0.9, with_entropy=True, entropy_grad=True)
    (lp.sum() + ent.sum()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert model.lm_head is head and (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model.zero_grad()
    logits = model(ids).logits[:, -5:-1]
    mask = batch["response_mask"].bool()
    want_lp = torch.where(mask, logprobs_from_logits(logits, ids[:, -4:], 0.9), 0.0)
    want_ent = torch.where(mask, entropy_from_logits(logits, 0.9), 0.0)
    (want_lp.sum() + want_ent.sum()).backward()
    assert torch.allclose(lp, want_lp, atol=1e-6) and torch.allclose(ent, want_ent, atol=1e-6)
    for name, param in model.named_parameters():
        assert torch.allclose(got[name], param.grad, atol=1e-6), name


def test_the_head_comes_back_after_an_error_and_wrapped_heads_are_left_alone():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    head = model.lm_head
    with pytest.raises(RuntimeError), detached_head(model) as detached:
        assert detached is head and isinstance(model.lm_head, torch.nn.Identity)
        raise RuntimeError("forward failed")
    assert model.lm_head is head
    model.lm_head = torch.nn.Sequential(head)  # not a plain Linear (a LoRA head, say): the forward is unchanged
    with detached_head(model) as detached:
        assert detached is None and isinstance(model.lm_head, torch.nn.Sequential)
