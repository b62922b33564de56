"""A Megatron backend's torch_dist checkpoint is checked before its workers load it
(rundir.py: checked_start, verify_megatron_checkpoint): a truncated or missing shard, a garbled ``common.pt`` or
one holding pickled code, and a tracker naming a missing iteration are named, and
``--load-previous-on-corruption`` falls back to the previous complete iteration.

The checkpoints here are written by torch.distributed.checkpoint in one process (the format
Megatron-Core's ``dist_checkpointing`` writes), so no Megatron model is built.

The cases of the reliability probes (docs/reliability/probe3_runs.md); each docstring names its id."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from posttrain.checkpoint import CheckpointLoad
from posttrain.errors import CheckpointError
from posttrain.rundir import checked_start

LOAD = CheckpointLoad(load="x", finetune=False)


@pytest.fixture(scope="module")
def dist_save(tmp_path_factory) -> Path:
    """A save dir with two torch_dist iterations (``iter_0000001``, ``iter_0000002``), tracker 2."""
    import torch.distributed.checkpoint as dcp

    save = tmp_path_factory.mktemp("dist")
    for it in (1, 2):
        path = save / f"iter_{it:07d}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: a single-process save
            dcp.save({"w": torch.arange(40_000.0) + it, "b": torch.ones(300)}, checkpoint_id=str(path))
        torch.save({"iteration": it, "checkpoint_version": 3.0}, path / "common.pt")
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    return save


def _copy(dist_save: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(dist_save, tmp_path / "save"))


def _shard(save: Path) -> Path:
    return next((save / "iter_0000002").glob("*.distcp"))


def test_a_complete_checkpoint_passes(dist_save):
    assert checked_start(str(dist_save), LOAD, megatron=True).source == str(dist_save)


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_bad_shard_is_named_and_the_previous_iteration_offered(dist_save, tmp_path, damage):
    """Probes F13a, RN28: the latest iteration's shard cut short, or deleted."""
    save = _copy(dist_save, tmp_path)
    shard = _shard(save)
    if damage == "truncated":
        os.truncate(shard, 1000)
    else:
        shard.unlink()
    with pytest.raises(CheckpointError) as info:
        checked_start(str(save), LOAD, megatron=True)
    text = str(info.value)
    assert str(shard) in text and ("truncated" in text if damage == "truncated" else "is missing" in text)
    assert "--load-previous-on-corruption" in text and "iter_0000001" in text


def test_load_previous_on_corruption_falls_back_on_a_bad_shard(dist_save, tmp_path, caplog):
    """Probe F13b: with --load-previous-on-corruption the run starts from iter_0000001, with a warning."""
    save = _copy(dist_save, tmp_path)
    os.truncate(_shard(save), 1000)
    start = checked_start(str(save), LOAD, megatron=True, load_previous_on_corruption=True)
    assert start.source == str(save / "iter_0000001")
    assert "resuming from the previous complete checkpoint" in caplog.text


@pytest.mark.parametrize("content", ["garbage", "code"])
def test_a_bad_common_pt_is_named_and_falls_back(dist_save, tmp_path, content, monkeypatch):
    """Probes F14, RN27: common.pt is garbage, or holds an os.system payload (which never runs); the
    message does not quote torch's advice to load with weights_only=False, and the flag falls back."""
    save = _copy(dist_save, tmp_path)
    common = save / "iter_0000002" / "common.pt"
    marker = tmp_path / "PWNED"
    if content == "garbage":
        common.write_text("garbage")
    else:
        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))
        torch.save({"iteration": 2, "x": Evil()}, common)
    with pytest.raises(CheckpointError) as info:
        checked_start(str(save), LOAD, megatron=True)
    assert str(common) in str(info.value) and "weights_only set to False" not in str(info.value)
    start = checked_start(str(save), LOAD, megatron=True, load_previous_on_corruption=True)
    assert start.source == str(save / "iter_0000001") and not marker.exists()


def test_a_tracker_naming_a_missing_iteration_falls_back(dist_save, tmp_path):
    """Probe RN30: the tracker names iteration 9: refused naming it; the flag falls back to iter_0000002."""
    save = _copy(dist_save, tmp_path)
    (save / "latest_checkpointed_iteration.txt").write_text("9\n")
    with pytest.raises(CheckpointError, match="names 9"):
        checked_start(str(save), LOAD, megatron=True)
    start = checked_start(str(save), LOAD, megatron=True, load_previous_on_corruption=True)
    assert start.source == str(save / "iter_0000002")


def test_no_earlier_iteration_to_fall_back_to_is_said(dist_save, tmp_path):
    """Probe RN26 (megatron): only iteration 1 and it is bad: the flag says there is nothing to fall back to."""
    save = _copy(dist_save, tmp_path)
    import shutil

    shutil.rmtree(save / "iter_0000002")
    (save / "latest_checkpointed_iteration.txt").write_text("1\n")
    os.truncate(next((save / "iter_0000001").glob("*.distcp")), 10)
    with pytest.raises(CheckpointError, match="no earlier checkpoint next to it to fall back to"):
        checked_start(str(save), LOAD, megatron=True, load_previous_on_corruption=True)


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PROBE_MARKER']}",))


def test_pickled_code_in_the_metadata_never_runs(dist_save, tmp_path, monkeypatch):
    """Probe RN39: torch reads .metadata with plain pickle: a payload there is refused before it can run."""
    import pickle

    save = _copy(dist_save, tmp_path)
    marker = tmp_path / "PWNED"
    monkeypatch.setenv("PROBE_MARKER", str(marker))
    metadata = save / "iter_0000002" / ".metadata"
    with open(metadata, "rb") as f:
        loaded = pickle.load(f)
    loaded.storage_meta = Evil()
    with open(metadata, "wb") as f:
        pickle.dump(loaded, f)
    with pytest.raises(CheckpointError, match="refused: it holds pickled Python objects") as info:
        checked_start(str(save), LOAD, megatron=True)
    assert str(metadata) in str(info.value) and not marker.exists()


def test_pickled_code_in_a_shard_never_runs(tmp_path, monkeypatch):
    """Probe RN40: an object pickled in a shard (Megatron unpickles them with weights_only=False) that
    holds code is refused naming the shard and the entry."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "PWNED"
    monkeypatch.setenv("PROBE_MARKER", str(marker))
    path = tmp_path / "save" / "iter_0000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(4), "rng_state": [Evil()]}, checkpoint_id=str(path))
    torch.save({"iteration": 1}, path / "common.pt")
    with pytest.raises(CheckpointError, match="its entry rng_state cannot be read safely") as info:
        checked_start(str(tmp_path / "save"), LOAD, megatron=True)
    assert ".distcp" in str(info.value) and not marker.exists()
