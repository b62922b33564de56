"""The offload keys on a real GPU (run by `make device-check`, skipped elsewhere): between updates
the optimizer state's bytes wait in pinned host memory and its device storage is empty, so the
device memory it held is free; during each step it is back on the GPU; the weights equal those of
the same updates without offload."""

from __future__ import annotations

import pytest
import torch

from tests.unit.train.offload_cases import moment_bytes, two_updates

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
