"""Log-probs and entropy from vocab-parallel logits (posttrain.train.megatron.vocab_parallel) on 2
gloo ranks (TP 2) equal the full-vocabulary computation, values and gradients, with a padded
vocabulary (12 real tokens padded to 14, 7 per rank) and a temperature."""

from __future__ import annotations

import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

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


def worker(rank: int, port: int, out: str) -> None:
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from posttrain.train.megatron.cpu_shims import cpu_megatron
        from posttrain.train.megatron.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
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
        dist.destroy_process_group()
        Path(out, f"rank{rank}").write_text("ok")
    except BaseException:  # noqa: BLE001 - the parent reads it
        Path(out, f"rank{rank}").write_text(traceback.format_exc())


def test_vocab_parallel_logprobs_and_entropy_equal_the_full_vocabulary(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == "ok"
