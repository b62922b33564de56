"""The separated placement (``use_integrated_worker: false``): the rollout in a Ray worker process,
the trainer in this one. Synchronous, it equals the in-process run; with ``async_staleness: 1`` it
equals the in-process asynchronous run (the rollout thread on a copy of the weights)."""

from __future__ import annotations

import pytest
from cluster_helpers import grpo_config, read_metrics
from test_ray_grpo import is_wall_clock, same

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def trained(work, name: str, **rl) -> list[dict]:
    from posttrain.trainers.stages import train

    cfg = grpo_config(work, name, workers=1, iters=3, rl=rl)
    train(cfg)
    return [r for r in read_metrics(work / f"run_{name}") if "actor/pg_loss" in r]


def assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] == [1, 2, 3]
    for g, w in zip(got, want):
        for key in (k for k in w if not is_wall_clock(k)):
            assert same(g[key], w[key], key), (w["iteration"], key)


def test_separated_rollout_equals_the_run_in_one_process(ray_cluster, work):
    local = trained(work, "sep_local")
    separated = trained(work, "sep_ray", use_integrated_worker=False)
    assert_same_rows(separated, local)
    assert all(r["rollout/staleness_max"] == 0 for r in separated)
    assert separated[0]["timing/resharding_to_infer"] >= 0  # the weights travelled to the worker


def test_separated_async_equals_the_in_process_async_run(ray_cluster, work):
    thread = trained(work, "async_thread", async_staleness=1)
    separated = trained(work, "async_ray", async_staleness=1, use_integrated_worker=False)
    assert_same_rows(separated, thread)
    assert [r["rollout/staleness_max"] for r in separated] == [0, 1, 1]
