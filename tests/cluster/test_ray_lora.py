"""GRPO-LoRA on 2 Ray workers (DDP over the adapter) equals the run in one process: the same
responses (the rollout samples from the merged adapter on each worker) and every logged metric; the
reference shares the backbone (the adapter off) on both; the adapter-only checkpoint is saved."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import grpo_config, record_run
from tests.cluster.test_ray_grpo import is_wall_clock, same

pytestmark = [pytest.mark.ray, pytest.mark.slow]
LORA = {"lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "lora_r": 8,
        "lora_alpha": 16, "lr": 2e-2}


def test_lora_on_two_workers_equals_one_process(ray_cluster, work):
    # padded rows: packed micro-batches hold other rows on one worker than on two, and their sums
    # differ in rounding, which AdamW's first steps on the fresh adapter amplify past 1e-5
    rl = {"epochs": 2, "shuffle_mini_batch": True, "init_kl_coef": 0.05, "share_backbone": True,
          "use_remove_padding": False}
    runs = {name: record_run(grpo_config(work, f"lora_{name}", workers=workers, iters=2, rl=rl, train={
        **LORA, "save": str(work / f"lora_{name}_ckpt"), "save_interval": 2, "lora_ckpt_filter": True}))
        for name, workers in (("local", 1), ("ray", 2))}
    (local_batches, local_rows, _), (ray_batches, ray_rows, _) = runs["local"], runs["ray"]
    assert ray_batches == local_batches and local_batches[0] != local_batches[-1]
    local_rows, ray_rows = [r for r in local_rows if "actor/pg_loss" in r], [r for r in ray_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in ray_rows] == [1, 2]
    for want, got in zip(local_rows, ray_rows):
        for key in (k for k in want if not is_wall_clock(k)):
            assert same(got[key], want[key], key), (want["iteration"], key)
    assert local_rows[-1]["actor/kl_loss"] > 0  # the adapter moved the actor away from the shared base
    saved = work / "lora_ray_ckpt" / "iter_0000002"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
