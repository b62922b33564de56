"""generate_config.offload_train_param's mechanism, run on the CPU (where the plan does not turn it
on: host and device are the same memory, and the key is listed in the start-up warning,
tests/unit/config/test_config_features.py; tests/gpu/test_offload_cuda.py checks the freed GPU
memory): while the native engine samples from its bf16 copy the actor's weights hold no storage,
the samples are those of an engine without the offload, also after an optimizer step moved the
weights (the copy is refreshed before they leave), and every weight comes back bit-exact. An engine
that samples from the weights themselves is refused by key."""

from __future__ import annotations

import pytest
from tests.unit.train.offload_cases import rollouts_with_weights_off, tiny_model

from posttrain.errors import ConfigError


def test_the_weights_leave_during_rollout_and_change_no_sample():
    run = rollouts_with_weights_off("cpu")
    assert run["samples"]["offloaded"] == run["samples"]["plain"]
    assert run["samples"]["offloaded"][0] != run["samples"]["offloaded"][1]  # the step changed what is sampled
    assert run["seen"]["weights"] == [0, 0]  # inside each generate
    assert run["exact"] and run["offload"].device_bytes() == run["weights"] and run["offload"].host_bytes() == 0


@pytest.mark.parametrize("why", ["float32", "lora"])
def test_an_engine_that_samples_from_the_weights_is_refused(why):
    from posttrain.models.lora import LoraOptions, MergedRollout, add_adapter
    from posttrain.rollout.native import NativeEngine
    from posttrain.training.offload import weights_off_during_rollout

    model = tiny_model("cpu")
    if why == "lora":  # the adapter merged into the base in place: no copy
        model = add_adapter(model, LoraOptions(r=2, alpha=4, target_modules=("q_proj",)))
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype="float32" if why == "float32" else "bfloat16")
    rollout = MergedRollout(engine, model) if why == "lora" else engine
    with pytest.raises(ConfigError, match=r"^generate_config.offload_train_param=true: the rollout engine "
                                          r"\(NativeEngine\) samples from the training weights themselves"):
        weights_off_during_rollout(rollout, model)


def test_fsdp2_shards_go_to_the_host_and_come_back_unchanged():
    """Under FSDP2 (FSDP2 with vLLM, whose engine holds its own copy) the storage of each rank's local
    shards is what moves (one rank of a fake 2-rank group; the collectives do nothing)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from posttrain.training.offload import WeightOffload

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = tiny_model("cpu")
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        offload = WeightOffload(model)
        before = [p.to_local().clone() for p in model.parameters()]
        local = offload.device_bytes()
        assert 0.45 * whole < local < 0.6 * whole  # about half: a shard, not the whole
        offload.to_host()
        assert offload.device_bytes() == 0 and offload.host_bytes() == local
        offload.to_device()
        assert offload.device_bytes() == local and offload.host_bytes() == 0
        assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
    finally:
        dist.destroy_process_group()
