"""The session's run directories (loops/session.py): ``train`` checks its output paths before the
work, writes only into its own run directories, locked for its lifetime, never into another run's,
never through a symlink, and a resume cuts the metrics back to the checkpoint.

The cases of the reliability probe (docs/reliability.md); each docstring names its probe id."""

from __future__ import annotations

import fcntl
import json
import os

import pytest

from tests.helpers.runs import copy_run, forbid, metrics_iterations, resume_args, run_cli, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_output_dir_that_is_a_file_is_refused_at_start_up(mini_world, tmp_path, capsys, monkeypatch):
    """Probe O5: ``rl_config.output_dir`` is an existing file."""
    (tmp_path / "afile").write_text("x")
    forbid(monkeypatch, "posttrain.loops.session:build_policy")
    code, err = run_cli(["train", *write_config(mini_world, tmp_path / "run"),
                         f"rl_config.output_dir={tmp_path / 'afile'}"], capsys)
    assert code == 2 and "rl_config.output_dir" in err and "is an existing file" in err


def test_save_dir_that_is_a_file_is_refused_at_start_up(mini_world, tmp_path, capsys, monkeypatch):
    """Probe O6: ``actor_config.save`` is an existing file."""
    (tmp_path / "afile").write_text("x")
    forbid(monkeypatch, "posttrain.loops.session:build_policy")
    code, err = run_cli(["train", *write_config(mini_world, tmp_path / "run"),
                         f"actor_config.save={tmp_path / 'afile'}"], capsys)
    assert code == 2 and "actor_config.save" in err and "is an existing file" in err


@pytest.mark.parametrize("key", ["actor_config.save", "rl_config.output_dir"], ids=["O7_save", "O8_output_dir"])
def test_unwritable_directory_is_refused_at_start_up(mini_world, tmp_path, capsys, monkeypatch, key):
    """Probes O7, O8: ``actor_config.save`` or ``rl_config.output_dir`` cannot be written."""
    import tempfile

    locked = tmp_path / "locked"
    locked.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # chmod does not stop root: refuse like a read-only mount
        if dir is not None and os.path.realpath(dir) == os.path.realpath(locked):
            raise PermissionError(13, "Permission denied", str(locked))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    forbid(monkeypatch, "posttrain.loops.session:build_policy")
    code, err = run_cli(["train", *write_config(mini_world, tmp_path / "run"), f"{key}={locked}"], capsys)
    assert code == 2 and f"{key} {locked} is not writable" in err


def test_tensorboard_log_dir_that_is_a_file_is_refused(mini_world, tmp_path, capsys, monkeypatch):
    """Probe O9: ``rl_config.tensorboard_log_dir`` is an existing file."""
    (tmp_path / "afile").write_text("x")
    forbid(monkeypatch, "posttrain.loops.session:build_policy")
    code, err = run_cli(["train", *write_config(mini_world, tmp_path / "run"), "rl_config.use_tensorboard=true",
                         f"rl_config.tensorboard_log_dir={tmp_path / 'afile'}"], capsys)
    assert code == 2 and "rl_config.tensorboard_log_dir" in err and "is an existing file" in err


@pytest.mark.parametrize("which", ["ckpt", "out"])
def test_second_run_on_a_locked_directory_is_refused(mini_world, tmp_path, capsys, monkeypatch, which):
    """Probe O10: two runs at the same time on the same ``save`` or ``output_dir``."""
    run = tmp_path / "run"
    (run / which).mkdir(parents=True)
    lock = run / which / ".posttrain.lock"
    with open(lock, "w") as held:  # another run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        forbid(monkeypatch, "posttrain.loops.session:build_policy")
        code, err = run_cli(["train", *write_config(mini_world, run)], capsys)
    assert code == 2 and f"{run / which} is in use by another run (process 4242)" in err and str(lock) in err
    assert not (run / "out" / "metrics.jsonl").exists()


def test_locks_are_released_at_the_end_of_a_run(base_run):
    """Probe O10: a finished run leaves its directories free."""
    for d in (base_run / "ckpt", base_run / "out"):
        with open(d / ".posttrain.lock") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
            fcntl.flock(f, fcntl.LOCK_UN)


def test_train_refuses_a_save_dir_holding_another_runs_checkpoints(base_run, mini_world, tmp_path, capsys, monkeypatch):
    run = copy_run(base_run, tmp_path / "run")
    forbid(monkeypatch, "posttrain.loops.session:build_policy")
    code, err = run_cli(["train", *write_config(mini_world, run)], capsys)  # a fresh run (no load) into base_run's ckpt
    assert code == 2 and f"actor_config.save {run / 'ckpt'} already holds checkpoints" in err
    assert "actor_config.load is not set" in err and f"actor_config.load={run / 'ckpt'}" in err


def test_train_refuses_an_output_dir_holding_another_runs_metrics(base_run, mini_world, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    (run / "out").mkdir(parents=True)
    (run / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    forbid(monkeypatch, "posttrain.loops.session:build_policy")
    code, err = run_cli(["train", *write_config(mini_world, run)], capsys)
    assert code == 2 and f"rl_config.output_dir {run / 'out'} already holds the metrics" in err
    assert (run / "out" / "metrics.jsonl").read_text() == '{"iteration": 1}\n'


def test_rerun_into_the_model_dir_it_loaded_is_refused(mini_world, tmp_path, capsys):
    """Probe K25: ``actor_config.load`` = ``actor_config.save`` = an HF model directory, ``finetune: true``, twice."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(mini_world / "model", model)
    argv = ["train", *write_config(mini_world, tmp_path / "run", iters=1), f"actor_config.load={model}",
            f"actor_config.save={model}", "actor_config.finetune=true"]
    assert run_cli(argv + [f"rl_config.output_dir={tmp_path / 'out1'}"], capsys)[0] == 0
    code, err = run_cli(argv + [f"rl_config.output_dir={tmp_path / 'out2'}"], capsys)
    assert code == 2 and f"actor_config.save {model} already holds checkpoints" in err
    assert "actor_config.finetune is true" in err
    assert (model / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_resume_cuts_the_metrics_back_to_the_checkpoint(base_run, mini_world, tmp_path, capsys):
    """Probe K6: metrics.jsonl after a kill between logging and saving, then a resume."""
    run = copy_run(base_run, tmp_path / "run")
    with open(run / "out" / "metrics.jsonl", "a") as f:  # killed after logging iteration 3, before saving it
        f.write(json.dumps({"iteration": 3, "actor/pg_loss": 0.5}) + "\n" + '{"iteration": 4, "act')
    (run / "out" / "eval.jsonl").write_text(json.dumps({"iteration": 3, "eval/accuracy": 0.0}) + "\n")
    code, _ = run_cli(["train", *write_config(mini_world, run), *resume_args(run, iters=4)], capsys)
    assert code == 0
    assert metrics_iterations(run) == [1, 2, 3, 4]
    assert (run / "out" / "eval.jsonl").read_text() == ""  # the eval logged after the last save is gone


def test_config_and_metrics_are_not_written_through_symlinks(base_run, mini_world, tmp_path, capsys):
    """Probe O11: out/config.json and out/metrics.jsonl are symlinks to a user's file."""
    user = tmp_path / "user.txt"
    user.write_text("USER DATA\n")
    fresh = tmp_path / "fresh"
    (fresh / "out").mkdir(parents=True)
    (fresh / "out" / "config.json").symlink_to(user)
    assert run_cli(["train", *write_config(mini_world, fresh, iters=1)], capsys)[0] == 0
    assert user.read_text() == "USER DATA\n"
    assert not (fresh / "out" / "config.json").is_symlink()
    # a resumed run rewrites metrics.jsonl (cut back) into a file of its own, never through a link
    run = copy_run(base_run, tmp_path / "run")
    user.write_text((run / "out" / "metrics.jsonl").read_text())
    (run / "out" / "metrics.jsonl").unlink()
    (run / "out" / "metrics.jsonl").symlink_to(user)
    before = user.read_text()
    assert run_cli(["train", *write_config(mini_world, run), *resume_args(run, iters=3)], capsys)[0] == 0
    assert user.read_text() == before
    assert not (run / "out" / "metrics.jsonl").is_symlink() and metrics_iterations(run) == [1, 2, 3]


def test_a_refused_run_leaves_the_directories_as_it_found_them(mini_world, tmp_path, capsys, monkeypatch):
    """Probe 2's leftovers: a train refused at start-up (its save dir is in use) leaves no output dir
    and no lock file of its own behind."""
    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    argv = write_config(mini_world, run)
    forbid(monkeypatch, "posttrain.loops.session:build_policy")
    with open(run / "ckpt" / ".posttrain.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, err = run_cli(["train", *argv, f"rl_config.output_dir={run / 'new' / 'out'}"], capsys)
    assert code == 2 and "is in use by another run" in err
    assert not (run / "new").exists()
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == [".posttrain.lock"]  # the holder's, kept


def test_a_full_disk_at_the_lock_file_is_one_message(mini_world, tmp_path, capsys, monkeypatch):
    """Probe I3: the lock file cannot be written (ENOSPC): the output dir and the disk are named, no
    traceback, and the directories this run created are removed again."""
    import errno

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("posttrain.rundir.os.pwrite", full)
    run = tmp_path / "run"
    code, err = run_cli(["train", *write_config(mini_world, run)], capsys)
    assert code == 2 and f"rl_config.output_dir {run / 'out'}: cannot write the lock file" in err
    assert "the disk is full" in err
    assert not (run / "out").exists() and not (run / "ckpt").exists()
