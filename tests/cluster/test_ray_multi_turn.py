"""Multi-turn rollout (the native engine's per-request loop, with the code tool loaded) on 2 Ray
workers equals the run in one process: the engine and the tools are built in each worker, and the
TransferDock's response_mask and tool_call_num columns travel back through Ray. The random-init
model writes no tool call, so this covers the plumbing; tool calls themselves are covered in one
process (tests/unit/rollout/test_multi_turn.py, tests/e2e/test_e2e_tool_use.py)."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import grpo_config, record_run
from tests.cluster.test_ray_grpo import is_wall_clock, same

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MULTI_TURN = {"multi_turn_enable": True, "async_engine": True, "tool_config_path": "configs/tools/retool.yaml",
              "max_tool_calls": 2, "max_total_response_length": 24}


def test_multi_turn_on_two_workers_equals_one_process(ray_cluster, work):
    from posttrain.errors import ConfigError
    from posttrain.tools.sandbox import detect_sandbox

    try:
        detect_sandbox()
    except ConfigError as err:
        pytest.skip(f"no sandbox on this host: {err}")
    runs = {name: record_run(grpo_config(work, f"multi_turn_{name}", workers=workers, iters=2, rl=MULTI_TURN))
            for name, workers in (("local", 1), ("ray", 2))}
    (local_batches, local_rows, _), (ray_batches, ray_rows, _) = runs["local"], runs["ray"]
    assert ray_batches == local_batches
    local_rows = [r for r in local_rows if "actor/pg_loss" in r]
    ray_rows = [r for r in ray_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in ray_rows] == [1, 2]
    for want, got in zip(local_rows, ray_rows):
        assert "tool_call_num/mean" in want and "tool_call_num/mean" in got
        for key in (k for k in want if not is_wall_clock(k) and not k.startswith("tool/")):
            assert same(got[key], want[key], key), (want["iteration"], key)


def test_turn_credit_on_one_turn_rows_equals_the_trajectory_run(work):
    """rl_config.turn_credit: turn through the whole loop in one process (the advantage phase reads the
    dock's response_mask): the random-init model calls no tool, so every row is one turn and the run
    must equal the trajectory-level one (two-turn rows: tests/integration/test_turn_credit.py)."""
    from posttrain.errors import ConfigError
    from posttrain.tools.sandbox import detect_sandbox

    try:
        detect_sandbox()
    except ConfigError as err:
        pytest.skip(f"no sandbox on this host: {err}")
    runs = {credit: record_run(grpo_config(work, f"turn_credit_{credit}", workers=1, iters=2,
                                           rl={**MULTI_TURN, "turn_credit": credit}))
            for credit in ("trajectory", "turn")}
    (want_batches, want_rows, _), (got_batches, got_rows, _) = runs["trajectory"], runs["turn"]
    assert got_batches == want_batches
    want_rows = [r for r in want_rows if "actor/pg_loss" in r]
    got_rows = [r for r in got_rows if "actor/pg_loss" in r]
    assert [r["iteration"] for r in got_rows] == [1, 2] and got_rows[0]["tool_call_num/mean"] == 0
    for want, got in zip(want_rows, got_rows):
        for key in (k for k in want if not is_wall_clock(k) and not k.startswith("tool/")):
            assert same(got[key], want[key], key), (want["iteration"], key)
