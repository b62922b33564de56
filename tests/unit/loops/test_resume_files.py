"""What an on-policy checkpoint saves of its experience source (loops/resume_files.py): the
in-flight experiences (``in_flight.pt``) and the partial-rollout dock (``partial_rollout.pt``) are
plain data read with ``weights_only=True``, so pickled code in them never runs; and a resume that
would drop them (another async or partial-rollout setting, or the file missing) is refused.

The cases of the reliability probes (docs/reliability/probe3_runs.md); each docstring names its id."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from posttrain.errors import CheckpointError, ConfigError
from posttrain.loops.experience import new_dock
from posttrain.loops.partial_rollout import PartialRollout
from posttrain.loops.produce import Experience
from posttrain.loops.resume_files import (IN_FLIGHT, PARTIAL, check_resumed_source, load_in_flight, load_partial,
                                          plain_experience)


def _dock(iteration: int):
    return new_dock(4, 2, guarantee_order=True, seed=1 + iteration)


def _new(iteration: int) -> Experience:
    return Experience(_dock(iteration))


def _experience(iteration: int) -> Experience:
    exp = Experience(_dock(iteration))
    exp.td.put(["prompts", "responses", "scores"], [0, 1, 2, 3],
               [[torch.tensor([1, 2])] * 4, [torch.tensor([3, 4, 5])] * 4, torch.arange(4.0)])
    exp.td.get("rollout", ["prompts"], 2)  # some rows consumed
    exp.timers.record("rollout", 1.0, 2.5)
    exp.acc.update({"grpo/score/mean": [0.0, 1.0], "timing/x": (3.0, 2.0)})
    exp.metrics["tool/calls"] = 2.0
    exp.num_gen_batches = 3
    return exp


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PROBE_MARKER']}",))


def _plant(path: Path, marker: Path, monkeypatch, key) -> None:
    monkeypatch.setenv("PROBE_MARKER", str(marker))
    saved = torch.load(path, weights_only=True)
    saved[key] = Evil()
    torch.save(saved, path)


def test_in_flight_experiences_round_trip_as_plain_data(tmp_path):
    """Probe KN2: the in-flight experiences are saved as plain data and come back equal (weights only)."""
    path = tmp_path / IN_FLIGHT
    torch.save({3: plain_experience(_experience(3))}, path)
    torch.load(path, weights_only=True)  # nothing but plain data
    [(it, back)] = load_in_flight(path, _new).items()
    want = _experience(3)
    assert it == 3 and back.td.state_dict()["rng"] == want.td.state_dict()["rng"]
    for column in ("prompts", "responses", "scores"):
        assert all(torch.equal(a, b) for a, b in zip(back.td.state_dict()["data"][column],
                                                     want.td.state_dict()["data"][column]))
    assert (back.td.state_dict()["consumed"]["rollout"] == want.td.state_dict()["consumed"]["rollout"]).all()
    assert back.timers.spans() == want.timers.spans() and back.acc.raw() == want.acc.raw()
    assert back.metrics == want.metrics and back.num_gen_batches == 3


@pytest.mark.parametrize("which", ["in_flight", "partial"])
def test_pickled_code_in_the_source_files_never_runs(tmp_path, monkeypatch, which):
    """Probes KN2, KN4: an os.system payload planted in in_flight.pt / partial_rollout.pt does not run at
    resume; the load is refused naming the file."""
    marker = tmp_path / "PWNED"
    if which == "in_flight":
        path = tmp_path / IN_FLIGHT
        torch.save({3: plain_experience(_experience(3))}, path)
        _plant(path, marker, monkeypatch, 99)
        load = lambda: load_in_flight(path, _new)  # noqa: E731
    else:
        pool = PartialRollout(n=2, global_batch_size=2, max_split=2, max_tokens=4, max_model_len=None)
        path = tmp_path / PARTIAL
        torch.save(pool.state_dict(), path)
        _plant(path, marker, monkeypatch, "_probe")
        load = lambda: load_partial(path, pool.dock)  # noqa: E731
    with pytest.raises(CheckpointError, match="refused: it holds pickled Python objects") as info:
        load()
    assert str(path) in str(info.value) and "posix.system" in str(info.value)
    assert not marker.exists()


def test_a_saved_dock_that_does_not_fit_names_the_file(tmp_path):
    """Probe RN13: in-flight samples of a run with another batch size are refused naming the file."""
    path = tmp_path / IN_FLIGHT
    torch.save({3: plain_experience(_experience(3))}, path)
    with pytest.raises(CheckpointError, match="global_batch_size") as info:
        load_in_flight(path, lambda it: Experience(new_dock(8, 2, guarantee_order=True, seed=it)))
    assert str(path) in str(info.value)


def test_another_object_in_in_flight_is_named(tmp_path):
    """Probe RN12: in_flight.pt holding a tensor is refused naming the file."""
    path = tmp_path / IN_FLIGHT
    torch.save(torch.zeros(3), path)
    with pytest.raises(CheckpointError, match="expected a dict of iteration") as info:
        load_in_flight(path, _new)
    assert str(path) in str(info.value)


# ---- a resume that would drop the saved samples is refused ------------------------------------------------
def _checkpoint(tmp_path: Path, files=(), **state) -> dict:
    ckpt = tmp_path / "iter_0000002"
    ckpt.mkdir()
    for name in files:
        (ckpt / name).write_bytes(b"x")
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    return {"iteration": 2, "checkpoint_dir": str(ckpt), **state}


ASYNC_1 = dict(async_staleness=1, in_flight_saved=True, partial_rollout_max_split=None)
PARTIAL_2 = dict(async_staleness=None, in_flight_saved=False, partial_rollout_max_split=2)


@pytest.mark.parametrize("staleness", [None, 0, 2], ids=["sync", "k0", "k2"])
def test_an_async_checkpoint_resumed_with_another_staleness_is_refused(tmp_path, staleness):
    """Probe E2b: the k=1 checkpoint resumed synchronously (or with k 0 or 2) would drop its in-flight samples."""
    state = _checkpoint(tmp_path, [IN_FLIGHT], **ASYNC_1)
    with pytest.raises(ConfigError, match="rl_config.async_staleness=1") as info:
        check_resumed_source(state, staleness=staleness, pipelined=staleness is not None, partial_max_split=None)
    assert "iter_0000002" in str(info.value) and "in_flight.pt" in str(info.value)
    check_resumed_source(state, staleness=1, pipelined=True, partial_max_split=None)  # the same setting resumes


@pytest.mark.parametrize("recorded", [True, False], ids=["this_version", "older_checkpoint"])
def test_a_missing_in_flight_file_is_refused(tmp_path, recorded):
    """Probe KN3: in_flight.pt deleted from an async checkpoint is refused naming it (also a checkpoint
    saved before ``in_flight_saved`` was recorded: its async_staleness says so)."""
    state = _checkpoint(tmp_path, **(ASYNC_1 if recorded else {"async_staleness": 1}))
    with pytest.raises(CheckpointError, match="in_flight.pt is missing"):
        check_resumed_source(state, staleness=1, pipelined=True, partial_max_split=None)


def test_partial_rollout_checkpoints_resume_only_with_their_setting(tmp_path):
    """Probes RN7, RN8, RN9: a partial-rollout checkpoint resumed without partial rollout, with another
    max_split, or with partial_rollout.pt missing, is refused naming it."""
    state = _checkpoint(tmp_path, [PARTIAL], **PARTIAL_2)
    with pytest.raises(ConfigError, match="partial_rollout_max_split=2"):
        check_resumed_source(state, staleness=None, pipelined=False, partial_max_split=None)
    with pytest.raises(ConfigError, match="partial_rollout_max_split=2"):
        check_resumed_source(state, staleness=None, pipelined=False, partial_max_split=4)
    check_resumed_source(state, staleness=None, pipelined=False, partial_max_split=2)
    (Path(state["checkpoint_dir"]) / PARTIAL).unlink()
    with pytest.raises(CheckpointError, match="partial_rollout.pt is missing"):
        check_resumed_source(state, staleness=None, pipelined=False, partial_max_split=2)


def test_a_synchronous_checkpoint_may_continue_asynchronously(tmp_path):
    """Probe RN11: nothing is dropped when a synchronous checkpoint is resumed with async_staleness."""
    state = _checkpoint(tmp_path, async_staleness=None, in_flight_saved=False, partial_rollout_max_split=None)
    check_resumed_source(state, staleness=1, pipelined=True, partial_max_split=None)
