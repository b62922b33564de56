"""The offload keys on a real GPU (run by the device check, skipped elsewhere): between updates the
optimizer state lives in pinned host memory and the device memory it held is free; during each
step it is back on the GPU; the weights equal those of the same updates without offload."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "train"))
from offload_cases import two_updates  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_optimizer_state_lives_on_the_host_between_updates():
    plain, _, _ = two_updates("cuda", offload=False)
    kept = torch.cuda.memory_allocated()
    del plain
    torch.cuda.empty_cache()
    offloaded, during, after = two_updates("cuda", offload=True)
    freed = torch.cuda.memory_allocated()
    assert during[-1] == {"cuda"} and after == [{"cpu"}, {"cpu"}]
    state = [v for s in offloaded.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert all(v.is_pinned() for v in state)
    moments = sum(v.numel() * v.element_size() for v in state)
    grads = sum(p.numel() * p.element_size() for p in offloaded.model.parameters())
    assert kept - freed >= 0.9 * (moments + grads)  # the moments and the gradients left the device


def test_offload_changes_no_weight():
    plain, _, _ = two_updates("cuda", offload=False)
    offloaded, _, _ = two_updates("cuda", offload=True)
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b)
