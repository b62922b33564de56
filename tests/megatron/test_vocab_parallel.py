"""Log-probs and entropy from vocab-parallel logits (posttrain.training.megatron.vocab_parallel) on 2
gloo ranks (TP 2) equal the full-vocabulary computation, values and gradients, with a padded
vocabulary (12 real tokens padded to 14, 7 per rank) and a temperature."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.spawn_ranks import run_on_ranks

pytestmark = pytest.mark.slow

VOCAB, PADDED, TEMPERATURE = 12, 14, 0.7


def full_reference(logits: torch.Tensor, targets: torch.Tensor):
    """Log-probs, entropy and the gradient of (sum log-probs + 0.3 sum entropy) on the unpadded vocabulary."""
    z = logits[..., :VOCAB].clone().requires_grad_(True)
    logp = torch.log_softmax(z / TEMPERATURE, dim=-1)
    chosen = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    (chosen.sum() + 0.3 * entropy.sum()).backward()
    grad = torch.cat([z.grad, torch.zeros(*z.shape[:-1], PADDED - VOCAB)], dim=-1)
    return chosen.detach(), entropy.detach(), grad


def worker(rank: int) -> None:
    from megatron.core import parallel_state as ps

    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

    with cpu_megatron():
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 5, PADDED, generator=g) * 3
        targets = torch.randint(0, VOCAB, (2, 5), generator=g)
        want_logp, want_entropy, want_grad = full_reference(logits, targets)
        local = logits[..., rank * 7:(rank + 1) * 7].clone().requires_grad_(True)
        logp = vocab_parallel_logprobs(local, targets, vocab_size=VOCAB, temperature=TEMPERATURE)
        entropy = vocab_parallel_entropy(local, vocab_size=VOCAB, temperature=TEMPERATURE)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
        torch.testing.assert_close(local.grad, want_grad[..., rank * 7:(rank + 1) * 7], rtol=0, atol=1e-5)
        ps.destroy_model_parallel()


def test_vocab_parallel_logprobs_and_entropy_equal_the_full_vocabulary(tmp_path):
    run_on_ranks(worker, out=tmp_path)
