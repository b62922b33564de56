"""The asynchronous pipeline under PPO (the critic's phases) and multi-turn rollout (the per-request
engine with the code tool, built again for the rollout's weight copy): k = 0 equals the synchronous
run metric for metric, and k = 1 trains on samples one version old. In one process, on the 2-layer
model of these tests (tests/integration/test_async_loop.py covers GRPO, resume and partial rollout)."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import grpo_config
from tests.cluster.test_ray_grpo import PPO, is_wall_clock, same
from tests.cluster.test_ray_multi_turn import MULTI_TURN
from tests.helpers.runs import read_metrics


def trained(work, name: str, **keys) -> list[dict]:
    from posttrain.commands.train import train_config as train

    train(grpo_config(work, name, workers=1, iters=3, **keys))
    return [r for r in read_metrics(work / f"run_{name}") if "actor/pg_loss" in r]


@pytest.mark.parametrize("algorithm", ["ppo", "multi_turn"])
def test_staleness_zero_equals_synchronous_and_one_lags_a_version(work, algorithm):
    if algorithm == "multi_turn":
        from posttrain.errors import ConfigError
        from posttrain.tools.sandbox import detect_sandbox

        try:
            detect_sandbox()
        except ConfigError as err:
            pytest.skip(f"no sandbox on this host: {err}")
    rl, train = ({**PPO, "init_kl_coef": 0.05}, {"stage": "ray_ppo"}) if algorithm == "ppo" else (MULTI_TURN, {})
    sync = trained(work, f"{algorithm}_sync", rl=rl, train=train)
    k0 = trained(work, f"{algorithm}_k0", rl={**rl, "async_staleness": 0}, train=train)
    k1 = trained(work, f"{algorithm}_k1", rl={**rl, "async_staleness": 1}, train=train)
    assert len(sync) == len(k0) == len(k1) == 3
    for want, got in zip(sync, k0):
        for key in (k for k in want if not is_wall_clock(k) and not k.startswith("tool/")):
            assert same(got[key], want[key], key), (want["iteration"], key)
    assert [r["rollout/staleness_max"] for r in k1] == [0, 1, 1]
