"""The verifier pool and RuleReward: real timeouts, recovery from dead workers, pathological
inputs, reuse across calls, weights and metrics."""

import os
import time
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.reward.pool import VerifierPool
from posttrain.reward.rule_reward import RuleReward
from posttrain.reward.verifiers import VERIFIERS
from tests.unit.reward import reward_helper_verifiers  # noqa: F401  (registers t_* verifiers in this process)

MODULES = ["tests.unit.reward.reward_helper_verifiers"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); it is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture(scope="module")
def rr():
    with RuleReward(["t_sleep", "t_pid"], [1.0, 0.0], verifier_parallel=1, verifier_timeout=2.0,
                    verifier_modules=MODULES) as reward:
        yield reward


def test_sleeping_verifier_times_out_and_its_worker_is_killed(rr):
    pid_before = int(rr.score_detailed(["0"], [""]).per_verifier["t_pid"][0])
    batch = rr.score_detailed(["0", "60", "0"], ["", "", ""])
    assert batch.per_verifier["t_sleep"] == [1.0, 0.0, 1.0]
    assert batch.status["t_sleep"] == [0, 1, 0]
    assert batch.metrics["reward/timeouts"] == 1.0
    assert batch.metrics["t_sleep_rewards/mean"] == pytest.approx(2 / 3)
    assert not _alive(pid_before), "the hung worker must be killed, not abandoned"
    pid_after = int(batch.per_verifier["t_pid"][2])
    assert pid_after != pid_before and _alive(pid_after)


def test_pool_is_reused_across_calls(rr):
    a = rr.score_detailed(["0"], [""]).per_verifier["t_pid"][0]
    b = rr.score_detailed(["0"], [""]).per_verifier["t_pid"][0]
    assert a == b


def test_dead_worker_is_replaced_and_the_batch_completes():
    with RuleReward(["t_crash"], [2.0], verifier_parallel=2, verifier_timeout=30,
                    verifier_modules=MODULES) as rr:
        responses = ["ok", "crash", "ok", "ok", "crash", "ok"]
        batch = rr.score_detailed(responses, [""] * 6)
        assert batch.per_verifier["t_crash"] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
        assert batch.scores == [2.0, 0.0, 2.0, 2.0, 0.0, 2.0]
        assert batch.metrics["reward/errors"] == 2.0
        assert rr.pool.restarts >= 2
        # the pool still works afterwards
        assert rr.score(["ok"], [""])[0] == [2.0]


def test_exceptions_score_zero_and_are_counted():
    with RuleReward(["t_raise", "t_pid"], [1.0, 0.0], verifier_parallel=1,
                    verifier_modules=MODULES) as rr:
        batch = rr.score_detailed(["a", "b"], ["", ""])
    assert batch.per_verifier["t_raise"] == [0.0, 0.0]
    assert batch.metrics["reward/errors"] == 2.0
    assert any("boom" in m for m in batch.errors)


def test_close_stops_every_worker():
    rr = RuleReward(["t_pid"], [1.0], verifier_parallel=2, verifier_modules=MODULES)
    pids = {int(p) for p in rr.score(["x"] * 8, [""] * 8)[0]}
    rr.close()
    time.sleep(0.1)
    assert pids and not any(_alive(p) for p in pids)


PATHOLOGICAL = [
    "<think>t</think><answer>\\boxed{9^{9^{9^{9}}}}</answer>",
    "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",
    "{" * 5000 + "}" * 5000,
    "<think>" + "Step 1: " * 5000 + "</think>" * 3000 + "x" * 40000 + "</answer>",
    "x" * 100_000 + " \\boxed{17}",
]


@pytest.mark.slow
def test_pathological_inputs_never_hang_or_crash():
    names = ["acc", "math_verify_reward", "math_equiv", "base_acc", "format", "strict_format", "step",
             "acc_for_dapo", "last_number"]
    with RuleReward(names, [1.0] * len(names), verifier_parallel=2, verifier_timeout=3.0) as rr:
        batch = rr.score_detailed(PATHOLOGICAL, ["17"] * len(PATHOLOGICAL))
        assert len(batch.scores) == len(PATHOLOGICAL)
        assert batch.per_verifier["math_equiv"][-1] == 1.0   # the 100k response is still scored
        assert batch.per_verifier["last_number"][-1] == 1.0
        assert batch.per_verifier["math_equiv"][0] == 0.0    # the power tower is not 17
        # and the pool is healthy afterwards
        assert rr.score(["\\boxed{17}"], ["17"])[1]["math_equiv_rewards/mean"] == 1.0


def test_weighted_scores_and_metric_names():
    with RuleReward(["math_equiv", "format"], [1.0, 0.5], verifier_parallel=0) as rr:
        responses = ["<think>a</think><answer>\\boxed{17}</answer>", "\\boxed{17}", "\\boxed{3}"]
        scores, metrics = rr.score(responses, ["17", "17", "17"])
    assert scores == [1.5, 1.0, 0.0]
    assert metrics["math_equiv_rewards/mean"] == pytest.approx(2 / 3)
    assert metrics["format_rewards/mean"] == pytest.approx(1 / 3)
    assert metrics["reward/timeouts"] == 0.0 and metrics["reward/errors"] == 0.0


def test_prompt_and_extra_columns_reach_verifiers_that_accept_them():
    with RuleReward(["t_prompt"], [1.0], verifier_parallel=0) as rr:
        batch = rr.score_detailed(["r", "r"], ["", ""], ["abc", "de"], tool_call_num=[1, 2])
    assert batch.per_verifier["t_prompt"] == [4.0, 4.0]


def test_overlong_penalty_is_added():
    with RuleReward(["math_equiv"], [1.0], verifier_parallel=0, overlong_buffer_enable=True,
                    overlong_buffer=4, overlong_buffer_penalty_factor=1.0, rollout_max_tokens=16) as rr:
        batch = rr.score_detailed(["\\boxed{1}"] * 3, ["1"] * 3, response_lengths=[10, 14, 20])
    assert batch.scores == [1.0, 0.5, 0.0]  # penalties 0, -2/4, -1


def test_config_errors():
    with pytest.raises(ConfigError, match="length mismatch: 2 vs 1"):
        RuleReward(["acc", "format"], [1.0], verifier_parallel=0)
    with pytest.raises(ConfigError, match="known: .*math_equiv"):
        RuleReward(["nope"], [1.0], verifier_parallel=0)
    with pytest.raises(ConfigError, match="cannot import"):
        RuleReward(["acc"], [1.0], verifier_parallel=0, verifier_modules=["no_such_module_xyz"])


@pytest.mark.slow
def test_uninterruptible_c_computation_is_killed():
    with RuleReward(["t_bigpow"], [1.0], verifier_parallel=1, verifier_timeout=1.0,
                    verifier_modules=MODULES) as rr:
        batch = rr.score_detailed(["1000"], [""])
        assert batch.status["t_bigpow"] == [1] and batch.metrics["reward/timeouts"] == 1.0


def test_memory_blowup_is_an_error_not_a_dead_machine():
    with RuleReward(["t_alloc"], [1.0], verifier_parallel=1, verifier_modules=MODULES,
                    memory_limit_mb=2048) as rr:
        batch = rr.score_detailed(["64", "0"], ["", ""])
    assert batch.per_verifier["t_alloc"] == [0.0, 0.0]
    assert batch.status["t_alloc"] == [2, 0]
    assert any("MemoryError" in m for m in batch.errors)


def test_worker_killed_from_outside_while_idle_is_replaced_without_losing_samples():
    import signal

    with RuleReward(["t_pid"], [1.0], verifier_parallel=1, verifier_modules=MODULES) as rr:
        pid = int(rr.score(["x"], [""])[0][0])
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        batch = rr.score_detailed(["x", "y", "z"], [""] * 3)
    assert batch.metrics["reward/errors"] == 0.0
    new = {int(p) for p in batch.per_verifier["t_pid"]}
    assert len(new) == 1 and pid not in new


def test_from_options():
    from posttrain.reward.rule_reward import RuleRewardOptions

    options = RuleRewardOptions(verifiers=("math_equiv",), weights=(2.0,), parallel=0, timeout=5,
                                overlong_buffer_enable=True, overlong_buffer=2, rollout_max_tokens=8)
    with RuleReward.from_options(options) as rr:
        batch = rr.score_detailed(["\\boxed{3}"] * 2, ["3"] * 2, response_lengths=[4, 7])
    assert batch.scores == [2.0, 1.5]  # 7 tokens: exceed 1 of buffer 2 -> -0.5


# ---- a verifier's children die with it (the reliability probe, docs/reliability.md) -----------------
def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


def _read_pid(path: Path) -> int:
    deadline = time.monotonic() + 5
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.02)
    return int(path.read_text())


def test_timed_out_verifier_children_are_killed(tmp_path):
    """Probe R11: a verifier that forks a sleeping child (``t_r11_fork``), timed out and returning."""
    spec = VERIFIERS.get("t_r11_fork")
    hang, ret = tmp_path / "hang.pid", tmp_path / "return.pid"
    pids = []
    pool = VerifierPool([spec], num_workers=1, timeout=1.0, modules=MODULES)
    try:
        scores, status, errors = pool.run([(0, "hang", str(hang), {}), (0, "return", str(ret), {})])
        assert status == [1, 0] and scores == [0.0, 1.0], errors
        pids += [_read_pid(hang), _read_pid(ret)]
        # the timed-out item's child went with its worker's process group
        assert _gone_within(pids[0], 3.0), "the timed-out verifier's child survived its timeout"
        assert _alive(pids[1])  # a finished item's child lives until the pool closes...
        pool.close()
        assert _gone_within(pids[1], 3.0), "a verifier's child survived the pool's close()"  # ...not longer
    finally:
        pool.close()
        for pid in pids:  # never leave a sleeper behind, even when an assertion failed
            try:
                os.kill(pid, 9)
            except OSError:
                pass
