"""The separated placement (``use_integrated_worker: false``): the rollout in a Ray worker process,
the trainer in this one. With ``async_staleness: 1`` it equals the in-process asynchronous run (the
rollout thread on a copy of the weights), which at k = 0 equals synchronous training
(tests/integration/test_async_loop.py): the weights travel to the worker after every update."""

from __future__ import annotations

import pytest
from cluster_helpers import grpo_config, read_metrics
from test_ray_grpo import is_wall_clock, same

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def trained(work, name: str, **rl) -> list[dict]:
    from posttrain.trainers.stages import train

    train(grpo_config(work, name, workers=1, iters=3, rl=rl))
    return [r for r in read_metrics(work / f"run_{name}") if "actor/pg_loss" in r]


def test_separated_async_equals_the_in_process_async_run(ray_cluster, work):
    thread = trained(work, "async_thread", async_staleness=1)
    separated = trained(work, "async_ray", async_staleness=1, use_integrated_worker=False)
    assert [r["iteration"] for r in separated] == [r["iteration"] for r in thread] == [1, 2, 3]
    for got, want in zip(separated, thread):
        for key in (k for k in want if not is_wall_clock(k)):
            assert same(got[key], want[key], key), (want["iteration"], key)
    assert [r["rollout/staleness_max"] for r in separated] == [0, 1, 1]
    assert all(r["timing/resharding_to_infer"] >= 0 for r in separated[1:])  # weights sent after each update
