"""``rollout_engine: vllm`` on 2 Ray actor workers (real vLLM in each worker's process, real Ray):
GRPO with DDP replicas and with FSDP2 shards against the same run in one process.

* Every worker's engine starts from its weights and takes every update: the probe metric
  ``rollout/sync_probe_diff`` (the largest over the workers) is below 1e-4 on every iteration, and
  the weight sync is timed (``timing/resharding_to_infer``).
* The runs do not depend on the placement: each prompt's request is seeded by the call's seed and
  the prompt's key, so each worker draws for its share of the prompts the tokens the one-process
  engine draws; a worker whose engine missed an update would sample other tokens and score other
  log-probs. Same response tokens, and every logged metric but the wall-clock ones within 1e-3.
* LoRA on FSDP2 shards: each engine takes the adapter merged into the gathered base at every sync.
* ``async_staleness: 1`` on FSDP2 shards: each worker's engine samples beside the update and loads
  the snapshot of the version the pipeline asks for (cluster/rollout_copy.py ``EngineCopy``); the run
  equals the same asynchronous run in one process (its engine loaded by ``EngineReplica``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import cluster_helpers
from tests.helpers.configs import run_config
from tests.helpers.local_ray import local_ray

pytestmark = pytest.mark.ray

WALL_CLOCK = ("timing/", "e2e_tps", "update_tps", "vllm_tps")


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster for the module: 2 CPUs, one per actor worker, 1 torch thread each."""
    with local_ray(2, VLLM_ENABLE_V1_MULTIPROCESSING="0") as ray:
        yield ray


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_tokenizer):
    """A random 2-layer Qwen2 with head dim 64 (vLLM's CPU attention kernels) and tied embeddings (the
    engine repacks vLLM's tied output layer after each sync: without it the first sync's probe
    differs by 0.13 here), with the tiny tokenizer, and a preprocessed prompt set."""
    from tests.helpers.vllm_models import write_vllm_world

    return write_vllm_world(tmp_path_factory.mktemp("vllm_ray"), tiny_tokenizer, 64, "prompts/data")


def vllm_run(work: Path, name: str, *, workers: int, sharding: str = "ddp", rl: dict | None = None,
             train: dict | None = None, iters: int = 2):
    """``iters`` GRPO iterations (4 prompts x 8 samples, 2 optimizer steps each) sampled by vLLM in fp32
    on ``workers`` Ray actor workers (1: in this process)."""
    rl = {"actor_resource": {"num_devices": workers}, "ray_timeout_s": 600, "rollout_engine": "vllm",
          "ray_sharding": sharding, "init_kl_coef": 0.05, **(rl or {})}
    gen = {"max_model_len": 64, "max_num_seqs": 64, "infer_tensor_parallel_size": 1, "dtype": "float32",
           "sampling_config": {"max_tokens": 12, "temperature": 1.0, "top_k": -1, "top_p": 1.0}}
    cfg = run_config(work / "model", work / "prompts/data", work / f"run_{name}", name=name, iters=iters, rl_config=rl,
                     generate_config=gen, megatron_training=train or {})
    workers_info = []
    build = cluster_helpers.session_and_trainer

    def keeping_workers(cfg):  # what the Ray workers said once their engines had started
        session, trainer = build(cfg)
        workers_info.extend(session.cluster.info if session.cluster is not None else [])
        return session, trainer

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cluster_helpers, "session_and_trainer", keeping_workers)
        return (*cluster_helpers.record_run(cfg), workers_info)


@pytest.fixture(scope="module")
def runs(ray_session, work):
    return {name: vllm_run(work, name, workers=workers, sharding=sharding)
            for name, workers, sharding in (("local", 1, "ddp"), ("ddp", 2, "ddp"), ("fsdp2", 2, "fsdp2"))}


@pytest.mark.parametrize("placement", ["ddp", "fsdp2"])
def test_each_worker_runs_its_own_engine_and_keeps_its_threads(runs, placement):
    """vLLM's CPU worker pins torch's thread count for its process: each worker keeps its one thread."""
    info = runs[placement][3]
    assert [i["rank"] for i in info] == [0, 1] and len({i["pid"] for i in info}) == 2
    assert all(i["rollout_holds_weights"] and i["threads"] == 1 for i in info), info


def logged(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "actor/pg_loss" in r]


@pytest.mark.parametrize("placement", ["ddp", "fsdp2"])
def test_every_engine_takes_every_update(runs, placement):
    _, rows, _, _ = runs[placement]
    rows = logged(rows)
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:  # iteration 1: the engines' start; 2: the sync after update 1
        assert row["rollout/sync_probe_diff"] < 1e-4, row["iteration"]
    assert any("timing/resharding_to_infer" in r for r in rows)
    assert all(r["actor/grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize("placement", ["ddp", "fsdp2"])
def test_the_run_on_two_workers_equals_the_run_in_one_process(runs, placement):
    (want_batches, want_rows, _, _), (got_batches, got_rows, _, _) = runs["local"], runs[placement]
    assert got_batches == want_batches  # each worker's share: the one-process engine's tokens
    assert len(want_batches) == 2 and want_batches[0] != want_batches[1]
    want_rows, got_rows = logged(want_rows), logged(got_rows)
    assert [r["iteration"] for r in got_rows] == [r["iteration"] for r in want_rows] == [1, 2]
    for want, got in zip(want_rows, got_rows):
        assert sorted(got) == sorted(want)
        compared = [k for k in want if k != "time" and not k.startswith(WALL_CLOCK)]
        assert len(compared) > 15 and want["actor/kl_loss"] >= 0
        for key in compared:
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-3), (want["iteration"], key)


def test_lora_on_fsdp2_shards_pushes_the_merged_weights(ray_session, work):
    """LoRA on FSDP2 shards: each worker's engine takes the adapter merged into the gathered base at
    every sync (the probe and every sampled token's log-prob match the trainer's, adapter on, after
    each update), while the adapter moves away from the shared base (the reference, adapter off)."""
    lora = {"lora_target_modules": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], "lora_r": 4,
            "lora_alpha": 8, "lr": 5e-2}
    _, rows, _, info = vllm_run(work, "fsdp2_lora", workers=2, sharding="fsdp2", rl={"share_backbone": True},
                                train=lora)
    rows = logged(rows)
    assert [r["iteration"] for r in rows] == [1, 2] and all(i["rollout_holds_weights"] for i in info)
    for row in rows:
        assert row["rollout/sync_probe_diff"] < 1e-4, row["iteration"]
        assert row["rollout/logprob_diff_max"] < 1e-4, row["iteration"]
    assert rows[0]["actor/grad_norm"] > 0 and rows[1]["actor/kl_loss"] > 0  # iteration 2 sampled a moved adapter


ASYNC = {"async_staleness": 1, "n_samples_per_prompt": 4}  # 4 prompts x 4 samples: 2 optimizer steps
SMALL = {"micro_batch_size": 4}


def test_async_staleness_on_two_workers_equals_the_async_run_in_one_process(ray_session, work):
    """k = 1, 3 iterations on FSDP2 shards (a snapshot is the full weights, gathered by all ranks, with the
    probe scored on them; DDP keeps its own replica's the same way, without the gather): iterations 1
    and 2 sample version 0 (the engines' start), iteration 3 version 1, which every worker's engine
    loads from its snapshot while update 2 runs beside it. A worker whose engine held another version
    (none loaded, or the trained weights of update 2) would sample other tokens and score other
    log-probs than the one-process run, whose engine the pipeline loads in this process."""
    want_batches, want_rows, _, _ = vllm_run(work, "async_local", workers=1, rl=ASYNC, train=SMALL, iters=3)
    got_batches, got_rows, _, info = vllm_run(work, "async_fsdp2", workers=2, sharding="fsdp2", rl=ASYNC, train=SMALL,
                                              iters=3)
    assert len(info) == 2 and all(i["rollout_holds_weights"] for i in info)
    assert got_batches == want_batches  # token-identical rollouts, iteration by iteration
    assert len(want_batches) == 3 and want_batches[2] not in want_batches[:2]
    assert_same_async_rows(want_rows, got_rows)


def assert_same_async_rows(want_rows: list[dict], got_rows: list[dict], skip: tuple[str, ...] = ()) -> None:
    """Three logged iterations with staleness 0, 1, 1, the third's engine loaded with version 1 (probe
    below 1e-4), and every metric but wall-clock ones and ``skip`` within 1e-3."""
    want_rows, got_rows = logged(want_rows), logged(got_rows)
    assert [r["iteration"] for r in got_rows] == [r["iteration"] for r in want_rows] == [1, 2, 3]
    assert [r["rollout/staleness_max"] for r in got_rows] == [0, 1, 1]
    assert got_rows[2]["rollout/sync_probe_diff"] < 1e-4 and "timing/resharding_to_infer" in got_rows[2]
    for want, got in zip(want_rows, got_rows):
        assert sorted(got) == sorted(want)
        compared = [k for k in want if k not in ("time", *skip) and not k.startswith(WALL_CLOCK)]
        assert len(compared) > 15
        for key in compared:
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-3), (want["iteration"], key)
