"""generate_config.offload_train_optimizer / offload_train_grad on the CPU: the engine's hooks run
around every update, free the gradients and change no result. (On a CPU host and device are the
same memory, so the optimizer state stays where it is; tests/gpu/test_offload_cuda.py checks the
move on a GPU.)"""

from __future__ import annotations

import pytest
import torch
from offload_cases import two_updates

from posttrain.config.run import run_config_from_dict


def test_an_update_with_offload_equals_one_without_and_frees_the_gradients():
    plain, _, _ = two_updates("cpu", offload=False)
    offloaded, during, after = two_updates("cpu", offload=True)
    for a, b in zip(plain.model.parameters(), offloaded.model.parameters()):
        assert torch.equal(a, b)
    assert all(p.grad is not None for p in plain.model.parameters())
    assert all(p.grad is None for p in offloaded.model.parameters())  # freed between updates
    assert during[0] == set() and during[-1] == {"cpu"} and after == [{"cpu"}, {"cpu"}]


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
