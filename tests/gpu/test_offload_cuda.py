"""The offload keys on a real GPU (run by `make device-check`, skipped elsewhere): between updates
the optimizer state's bytes wait in pinned host memory and its device storage is empty, so the
device memory it held is free; during each step it is back on the GPU; the weights equal those of
the same updates without offload. ``offload_train_param``: while the native engine samples from its
bf16 copy, the fp32 weights' device memory is free (their bytes pinned on the host), the samples are
those of an engine without the offload, and the weights come back bit-exact."""

from __future__ import annotations

import pytest
import torch

from tests.unit.train.offload_cases import moment_bytes, rollouts_with_weights_off, two_updates

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_optimizer_state_lives_on_the_host_between_updates():
    plain, _, _ = two_updates("cuda", offload=False)
    kept = torch.cuda.memory_allocated()
    del plain
    torch.cuda.empty_cache()
    offloaded, during, after = two_updates("cuda", offload=True)
    freed = torch.cuda.memory_allocated()
    moments = moment_bytes(offloaded.model)
    assert during[-1] == moments and after == [0, 0]
    assert offloaded.offload.host_bytes() == moments
    assert all(host.is_pinned() for _, host in offloaded.offload.held)
    grads = moments // 2
    assert kept - freed >= 0.9 * (moments + grads)  # the moments and the gradients left the device


def test_offload_changes_no_weight():
    plain, _, _ = two_updates("cuda", offload=False)
    offloaded, _, _ = two_updates("cuda", offload=True)
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b)


def test_the_weights_wait_in_pinned_host_memory_during_rollout():
    torch.cuda.empty_cache()
    run = rollouts_with_weights_off("cuda", hidden=512)  # 2 layers of width 512: ~19 MiB of fp32 weights
    assert run["samples"]["offloaded"] == run["samples"]["plain"]
    assert run["samples"]["offloaded"][0] != run["samples"]["offloaded"][1]  # sampled from the refreshed copy
    assert run["seen"]["weights"] == [0, 0] and run["exact"]
    # inside generate the device holds the bf16 copy (half the weights) and not the fp32 weights
    # (without the offload: before + 0.5 and before + 2.5 weights); the second call also holds
    # AdamW's two moments
    weights, before = run["weights"], run["before_allocated"]
    first, second = run["seen"]["allocated"]
    assert first <= before - 0.4 * weights, (first, before, weights)
    assert second <= before + 1.6 * weights, (second, before, weights)
    offload = run["offload"]
    offload.to_host()
    assert all(host.is_pinned() for _, host in offload.held) and offload.host_bytes() == weights
    offload.to_device()
