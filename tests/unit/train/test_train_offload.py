"""generate_config.offload_train_optimizer / offload_train_grad on the CPU: the engine's hooks run
around every update, free the gradients and change no result. (On a CPU host and device are the
same memory, so the optimizer state stays where it is; tests/gpu/test_offload_cuda.py checks the
move on a GPU.)"""

from __future__ import annotations

import pytest
import torch
from tests.unit.train.offload_cases import moment_bytes, two_updates

from posttrain.config.run import run_config_from_dict


def test_an_update_with_offload_equals_one_without_and_frees_the_gradients():
    plain, _, kept = two_updates("cpu", offload=False)
    offloaded, during, after = two_updates("cpu", offload=True)
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b)
    assert all(p.grad is not None for p in plain.model.parameters())
    assert all(p.grad is None for p in offloaded.model.parameters())  # freed between updates
    moments = moment_bytes(offloaded.model)
    assert kept == [moments, moments]
    # the mechanism the plan turns on where host and device differ, run here on the CPU: between
    # updates the moments' storages are empty and their bytes wait in host copies; during each
    # step of the second update they are back in place
    assert after == [0, 0] and offloaded.offload.host_bytes() == moments
    assert during[0] == 0 and during[-1] == moments


def test_fsdp2_state_goes_to_the_host_and_comes_back_unchanged():
    """FSDP2's optimizer state is DTensors: the storage of each rank's local shard is what moves
    (one rank of a fake 2-rank group; the collectives do nothing, the state is real)."""
    import torch.distributed as dist
    from tests.unit.train.offload_cases import tiny_model
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from posttrain.training.offload import StateOffload
    from posttrain.training.optim import build_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = tiny_model("cpu")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.0)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        offload = StateOffload(optimizer, optimizer_state=True, grads=True)
        before = [v.to_local().clone() for s in optimizer.state.values() for k, v in s.items() if k != "step"]
        local_bytes = offload.device_bytes()
        assert 0 < local_bytes < 0.6 * moment_bytes(model)  # about half: a shard, not the whole
        offload.to_host()
        assert offload.device_bytes() == 0 and offload.host_bytes() == local_bytes
        assert all(p.grad is None for p in model.parameters())
        offload.to_device()
        after = [v.to_local() for s in optimizer.state.values() for k, v in s.items() if k != "step"]
        assert offload.device_bytes() == local_bytes
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    finally:
        dist.destroy_process_group()


def config(device: str, **generate):
    return run_config_from_dict({
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 2, "micro_batch_size": 2, "seq_length": 64,
                              "train_iters": 1},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "device": device},
        "generate_config": {"max_model_len": 64, "infer_tensor_parallel_size": 1, **generate}}, name="offload")


@pytest.mark.parametrize("device,expected", [("cuda", True), ("cpu", False)])
def test_the_plan_offloads_the_optimizer_only_where_host_and_device_differ(device, expected):
    from posttrain.config.plan import build_plan
    from posttrain.config.validate import validate_run_config

    def plan(cfg):
        return build_plan(cfg, validate_run_config(cfg, device_type=device), device=device)

    offloading = plan(config(device, offload_train_optimizer=True, offload_train_grad=True))
    assert (offloading.offload_optimizer, offloading.offload_grads) == (expected, True)
    assert not plan(config(device)).offload_optimizer
