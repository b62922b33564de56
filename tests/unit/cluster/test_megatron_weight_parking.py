"""``generate_config.offload_train_param`` on the megatron backend (CUDA): every rank's trained
weights wait in host memory from its ``generate`` (the leader samples from its own copy: vLLM's, or
its HF copy) until the next pass over the model. The worker's calls are checked here on a CPU with
a stand-in rollout and chunks whose parameters are views of one buffer, as Megatron's DDP lays them
out; the CPU has nothing to offload in a real run (the key is warned as having no effect there)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from posttrain.cluster.megatron_worker import MegatronWorker
from posttrain.training.offload import WeightOffload


def chunk_on_one_buffer() -> torch.nn.Module:
    """Two linear layers whose weights are views into one flat buffer (Megatron's param buffer)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 2, bias=False))
    buffer = torch.randn(12 + 6)
    with torch.no_grad():
        model[0].weight.data = buffer[:12].view(3, 4)
        model[1].weight.data = buffer[12:].view(2, 3)
    return model


def worker(chunk, rollout) -> MegatronWorker:
    w = object.__new__(MegatronWorker)
    w.device = "cuda"  # as on a GPU: no CPU shims around the passes
    w.policy = SimpleNamespace(rollout=rollout)
    w.parked = WeightOffload(torch.nn.ModuleList([chunk]))
    return w


def test_the_weights_wait_on_the_host_from_generate_to_the_next_pass():
    chunk = chunk_on_one_buffer()
    before = [p.detach().clone() for p in chunk.parameters()]
    seen = []

    class Leader:  # samples from its own copy: the chunk's storage must be empty meanwhile
        def generate(self, *args, **kwargs):
            seen.append(sum(p.untyped_storage().nbytes() for p in chunk.parameters()))
            return [["sample"]]

    w = worker(chunk, Leader())
    assert len(w.parked.storages()) == 1  # the two views share one storage: it moves once
    assert w.generate([[1, 2]], 1, None, []) == [["sample"]]
    assert seen == [0] and w.parked.device_bytes() == 0 and w.parked.host_bytes() == 18 * 4
    with w.megatron():  # the next pass (log-probs, update, save): the weights are back, bit for bit
        assert all(torch.equal(p, b) for p, b in zip(chunk.parameters(), before))
    assert w.parked.host_bytes() == 0


def test_a_rank_without_the_rollout_parks_its_weights_too():
    chunk = chunk_on_one_buffer()
    w = worker(chunk, None)  # not the replica's leader
    assert w.generate([[1, 2]], 1, None, []) == []
    assert w.parked.device_bytes() == 0  # its GPU is free for the leader's vLLM workers
    with contextlib.ExitStack() as stack:
        stack.enter_context(w.megatron())
    assert w.parked.device_bytes() == 18 * 4
