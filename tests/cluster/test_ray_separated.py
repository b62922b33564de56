"""The separate rollout worker (``separate_rollout_worker: true``): the rollout in a Ray worker process,
the trainer in this one. With ``async_staleness: 1`` it equals the in-process asynchronous run (the
rollout thread on a copy of the weights), which at k = 0 equals synchronous training
(tests/integration/test_async_loop.py): the weights travel to the worker after every update. The
worker decodes with n-gram speculation, which is exact: the same tokens as the thread's plain
decode, in fewer forward passes."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import grpo_config
from tests.cluster.test_ray_grpo import is_wall_clock, same
from tests.helpers.runs import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def trained(work, name: str, speculative_tokens: int = 0, **rl) -> list[dict]:
    from posttrain.commands.train import train_config as train

    # 2 prompts x 4 samples: 8 rows, few enough for the engine to feed drafts from the first step
    cfg = grpo_config(work, name, workers=1, iters=3, rl={"n_samples_per_prompt": 4, **rl},
                      train={"global_batch_size": 2})
    cfg.generate.num_speculative_tokens = speculative_tokens
    train(cfg)
    return [r for r in read_metrics(work / f"run_{name}") if "actor/pg_loss" in r]


def test_separated_async_equals_the_in_process_async_run(ray_cluster, work):
    thread = trained(work, "async_thread", async_staleness=1)
    separated = trained(work, "async_ray", speculative_tokens=4, async_staleness=1, separate_rollout_worker=True)
    assert [r["iteration"] for r in separated] == [r["iteration"] for r in thread] == [1, 2, 3]
    assert sum(r["rollout/draft_tokens"] for r in separated) > 0  # the worker's engine speculated
    for got, want in zip(separated, thread):
        for key in (k for k in want if not is_wall_clock(k)):
            assert same(got[key], want[key], key), (want["iteration"], key)
    assert [r["rollout/staleness_max"] for r in separated] == [0, 1, 1]
    assert all(r["timing/resharding_to_infer"] >= 0 for r in separated[1:])  # weights sent after each update
