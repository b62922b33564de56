"""Reliability probe, outputs (/work/shared/reviews/reliability_probe.md sections 1.6, 3): a command
never deletes or overwrites what it did not write, checks its output paths before the work, and
``train`` writes only into its own run directories, locked for its lifetime."""

from __future__ import annotations

import fcntl
import json
import os
import stat

import pytest

from reliability_world import (  # noqa: F401  (fixtures)
    base, copy_run, metrics_iterations, one_thread, resume_args, run_config, world, write_config)

pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(argv, capsys):
    from posttrain.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


def tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def forbid(monkeypatch, target: str):
    """Make ``target`` (module:attr) fail the test if called: the command must stop before the work."""
    module, attr = target.split(":")

    def called(*a, **k):
        raise AssertionError(f"{target} ran: the output path was not checked before the work")

    monkeypatch.setattr(f"{module}.{attr}", called)


# ---- init-model ------------------------------------------------------------------------------------
def _checkpoint_like(path):
    path.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "sampler.pt",
                 "trainer_state.json"):
        (path / name).write_text(name)


def _run_dir_like(path):
    (path / "ckpt" / "iter_0000001").mkdir(parents=True)
    (path / "ckpt" / "iter_0000001" / "model.safetensors").write_text("w")
    (path / "out").mkdir()
    (path / "out" / "metrics.jsonl").write_text("{}\n")
    (path / "NOTES.txt").write_text("mine")


@pytest.mark.parametrize("make", [_checkpoint_like, _run_dir_like], ids=["O1_iter_dir", "O2_run_dir"])
def test_O1_O2_init_model_refuses_nonempty_output(tmp_path, capsys, monkeypatch, make):
    target = tmp_path / "target"
    make(target)
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    forbid(monkeypatch, "posttrain.models.init_model:train_tokenizer")
    code, err = run_cli(["init-model", "--output", str(target)], capsys)
    assert code == 2 and f"--output {target} is not empty" in err and "--force" in err
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before


def test_O1_force_replaces_only_init_model_files(tmp_path, capsys):
    target = tmp_path / "iter"
    _checkpoint_like(target)
    (target / "sub").mkdir()
    (target / "sub" / "keep.txt").write_text("keep")
    code, _ = run_cli(["init-model", "--output", str(target), "--force"], capsys)
    assert code == 0
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen2"
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt", "sampler.pt", "trainer_state.json"):
        assert (target / name).read_text() == name  # never deleted nor touched
    assert (target / "sub" / "keep.txt").read_text() == "keep"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


def test_O3_init_model_refuses_the_current_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "important.txt").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f.txt").write_text("b")
    monkeypatch.chdir(tmp_path / "sub")
    for output in (".", "..", str(tmp_path)):
        for extra in ([], ["--force"]):
            code, err = run_cli(["init-model", "--output", output, *extra], capsys)
            assert code == 2 and "is the current directory" in err
    assert tree(tmp_path) == ["important.txt", "sub", "sub/f.txt"]


def test_O4_init_model_output_is_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    code, err = run_cli(["init-model", "--output", str(tmp_path / "afile")], capsys)
    assert code == 2 and "is an existing file" in err and (tmp_path / "afile").read_text() == "x"


def test_O15_model_and_checkpoint_files_are_readable(tmp_path, capsys, world):
    from transformers import AutoModelForCausalLM

    from posttrain.checkpoint import save_checkpoint

    old = os.umask(0o022)
    try:
        assert run_cli(["init-model", "--output", str(tmp_path / "m")], capsys)[0] == 0
        model = AutoModelForCausalLM.from_pretrained(world / "model")
        save_checkpoint(tmp_path / "ckpt", 1, model)
    finally:
        os.umask(old)
    for root in (tmp_path / "m", tmp_path / "ckpt" / "iter_0000001"):
        assert stat.S_IMODE(root.stat().st_mode) == 0o755, root
        for f in root.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


# ---- preprocess, eval, score, bench: outputs checked before the work --------------------------------
def test_item1_preprocess_refuses_an_existing_dataset_unless_force(world, tmp_path, capsys, monkeypatch):
    prefix = tmp_path / "data" / "rl"
    argv = ["preprocess", "--config-name", "demo_chain_sum", f"input={world / 'rl.jsonl'}",
            f"tokenizer_name_or_path={world / 'model'}", f"output_prefix={prefix}",
            "map_keys.prompt=problem", "map_keys.response=answer"]
    prefix.parent.mkdir()
    (prefix.parent / "rl_packed_input_ids_document.bin").write_bytes(b"mine")
    real_preprocess = __import__("posttrain.data.preprocess", fromlist=["x"]).preprocess
    forbid(monkeypatch, "posttrain.data.preprocess:preprocess")
    code, err = run_cli(argv, capsys)
    assert code == 2 and "rl_packed_input_ids_document.bin" in err and "--force" in err
    assert (prefix.parent / "rl_packed_input_ids_document.bin").read_bytes() == b"mine"
    monkeypatch.setattr("posttrain.data.preprocess.preprocess", real_preprocess)
    assert run_cli([*argv, "--force"], capsys)[0] == 0
    assert (prefix.parent / "rl_packed_input_ids_document.bin").stat().st_size > 4


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_X13_eval_output_checked_before_the_work(world, tmp_path, capsys, monkeypatch, kind):
    out = tmp_path / "res.json"
    out.mkdir() if kind == "dir" else out.write_text("mine")
    forbid(monkeypatch, "posttrain.models.loading:load_causal_lm")
    code, err = run_cli(["eval", "--model", str(world / "model"), "--data", str(world / "data" / "rl"),
                         "--output", str(out)], capsys)
    assert code == 2 and f"--output {out}" in err
    assert ("is an existing directory" in err) if kind == "dir" else ("already exists" in err and "--force" in err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json"]  # no .tmp left


def test_X13_eval_force_replaces_the_output(world, tmp_path, capsys):
    out = tmp_path / "res.json"
    out.write_text("old")
    code, _ = run_cli(["eval", "--model", str(world / "model"), "--data", str(world / "data" / "rl"),
                       "--output", str(out), "--force", "--limit", "2", "--max-tokens", "2"], capsys)
    assert code == 0 and json.loads(out.read_text())["num_prompts"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json"]


def test_eval_samples_file_holds_every_response(world, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    samples.write_text("old")
    argv = ["eval", "--model", str(world / "model"), "--data", str(world / "data" / "rl"), "--limit", "2",
            "--max-tokens", "2", "--n", "2", "--temperature", "1", "--samples", str(samples)]
    code, err = run_cli(argv, capsys)
    assert code == 2 and f"--samples {samples}" in err and samples.read_text() == "old"
    assert run_cli([*argv, "--force"], capsys)[0] == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["prompt"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(isinstance(r["response"], str) and r["score"] in (0.0, 1.0) for r in rows)


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_R17_score_output_checked_before_the_work(tmp_path, capsys, monkeypatch, kind):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"response": "1", "label": "1"}) + "\n")
    out = tmp_path / "out"
    out.mkdir() if kind == "dir" else out.write_text("mine")
    forbid(monkeypatch, "posttrain.commands.score:score_rows")
    code, err = run_cli(["score", "--verifier", "last_number", "--input", str(src), "--output", str(out)], capsys)
    assert code == 2 and f"--output {out}" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]
    if kind == "file":
        assert out.read_text() == "mine"


@pytest.mark.parametrize("flag,kind", [("--output", "dir"), ("--output", "file"), ("--profile", "file"),
                                       ("--profile", "dir_with_profile")])
def test_X17_bench_outputs_checked_before_the_work(world, tmp_path, capsys, monkeypatch, flag, kind):
    target = tmp_path / "target"
    if kind == "dir":
        target.mkdir()
    elif kind == "file":
        target.write_text("mine")
    else:
        target.mkdir()
        (target / "profile.txt").write_text("mine")
    forbid(monkeypatch, "posttrain.commands.bench:bench")
    code, err = run_cli(["bench", *write_config(world, tmp_path / "run"), flag, str(target)], capsys)
    assert code == 2 and f"{flag} {target}" in err
    assert not [p for p in tmp_path.rglob(".*tmp*")]


# ---- train: its run directories ----------------------------------------------------------------------
def test_O5_output_dir_is_an_existing_file(world, tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("x")
    forbid(monkeypatch, "posttrain.trainers.session:build_policy")
    code, err = run_cli(["train", *write_config(world, tmp_path / "run"), f"rl_config.output_dir={tmp_path / 'afile'}"],
                        capsys)
    assert code == 2 and "rl_config.output_dir" in err and "is an existing file" in err


def test_O6_save_is_an_existing_file_refused_at_start_up(world, tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("x")
    forbid(monkeypatch, "posttrain.trainers.session:build_policy")
    code, err = run_cli(["train", *write_config(world, tmp_path / "run"), f"actor_config.save={tmp_path / 'afile'}"],
                        capsys)
    assert code == 2 and "actor_config.save" in err and "is an existing file" in err


@pytest.mark.parametrize("key", ["actor_config.save", "rl_config.output_dir"], ids=["O7_save", "O8_output_dir"])
def test_O7_O8_unwritable_directory_refused_at_start_up(world, tmp_path, capsys, monkeypatch, key):
    import tempfile

    locked = tmp_path / "locked"
    locked.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # chmod does not stop root: refuse like a read-only mount
        if dir is not None and os.path.realpath(dir) == os.path.realpath(locked):
            raise PermissionError(13, "Permission denied", str(locked))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    forbid(monkeypatch, "posttrain.trainers.session:build_policy")
    code, err = run_cli(["train", *write_config(world, tmp_path / "run"), f"{key}={locked}"], capsys)
    assert code == 2 and f"{key} {locked} is not writable" in err


def test_O9_tensorboard_log_dir_is_a_file(world, tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("x")
    forbid(monkeypatch, "posttrain.trainers.session:build_policy")
    code, err = run_cli(["train", *write_config(world, tmp_path / "run"), "rl_config.use_tensorboard=true",
                         f"rl_config.tensorboard_log_dir={tmp_path / 'afile'}"], capsys)
    assert code == 2 and "rl_config.tensorboard_log_dir" in err and "is an existing file" in err


@pytest.mark.parametrize("which", ["ckpt", "out"])
def test_O10_second_run_on_a_locked_directory_refuses(world, tmp_path, capsys, monkeypatch, which):
    run = tmp_path / "run"
    (run / which).mkdir(parents=True)
    lock = run / which / ".posttrain.lock"
    with open(lock, "w") as held:  # another run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        forbid(monkeypatch, "posttrain.trainers.session:build_policy")
        code, err = run_cli(["train", *write_config(world, run)], capsys)
    assert code == 2 and f"{run / which} is in use by another run (process 4242)" in err and str(lock) in err
    assert not (run / "out" / "metrics.jsonl").exists()


def test_O10_lock_is_released_at_the_end_of_a_run(base):
    for d in (base / "ckpt", base / "out"):
        with open(d / ".posttrain.lock") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
            fcntl.flock(f, fcntl.LOCK_UN)


def test_train_refuses_a_save_dir_holding_another_runs_checkpoints(base, world, tmp_path, capsys, monkeypatch):
    run = copy_run(base, tmp_path / "run")
    forbid(monkeypatch, "posttrain.trainers.session:build_policy")
    code, err = run_cli(["train", *write_config(world, run)], capsys)  # a fresh run (no load) into base's ckpt
    assert code == 2 and f"actor_config.save {run / 'ckpt'} already holds checkpoints" in err
    assert "actor_config.load is not set" in err and f"actor_config.load={run / 'ckpt'}" in err


def test_train_refuses_an_output_dir_holding_another_runs_metrics(base, world, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    (run / "out").mkdir(parents=True)
    (run / "out" / "metrics.jsonl").write_text('{"iteration": 1}\n')
    forbid(monkeypatch, "posttrain.trainers.session:build_policy")
    code, err = run_cli(["train", *write_config(world, run)], capsys)
    assert code == 2 and f"rl_config.output_dir {run / 'out'} already holds the metrics" in err
    assert (run / "out" / "metrics.jsonl").read_text() == '{"iteration": 1}\n'


def test_K25_rerun_with_load_equal_save_equal_model_dir_is_refused(world, tmp_path, capsys):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(world / "model", model)
    argv = ["train", *write_config(world, tmp_path / "run", iters=1), f"actor_config.load={model}",
            f"actor_config.save={model}", "actor_config.finetune=true"]
    assert run_cli(argv + [f"rl_config.output_dir={tmp_path / 'out1'}"], capsys)[0] == 0
    code, err = run_cli(argv + [f"rl_config.output_dir={tmp_path / 'out2'}"], capsys)
    assert code == 2 and f"actor_config.save {model} already holds checkpoints" in err
    assert "actor_config.finetune is true" in err
    assert (model / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_K6_resume_cuts_the_metrics_back_to_the_checkpoint(base, world, tmp_path, capsys):
    run = copy_run(base, tmp_path / "run")
    with open(run / "out" / "metrics.jsonl", "a") as f:  # killed after logging iteration 3, before saving it
        f.write(json.dumps({"iteration": 3, "actor/pg_loss": 0.5}) + "\n" + '{"iteration": 4, "act')
    (run / "out" / "eval.jsonl").write_text(json.dumps({"iteration": 3, "eval/accuracy": 0.0}) + "\n")
    code, _ = run_cli(["train", *write_config(world, run), *resume_args(run, iters=4)], capsys)
    assert code == 0
    assert metrics_iterations(run) == [1, 2, 3, 4]
    assert (run / "out" / "eval.jsonl").read_text() == ""  # the eval logged after the last save is gone


def test_O11_config_and_metrics_are_not_written_through_symlinks(base, world, tmp_path, capsys):
    user = tmp_path / "user.txt"
    user.write_text("USER DATA\n")
    fresh = tmp_path / "fresh"
    (fresh / "out").mkdir(parents=True)
    (fresh / "out" / "config.json").symlink_to(user)
    assert run_cli(["train", *write_config(world, fresh, iters=1)], capsys)[0] == 0
    assert user.read_text() == "USER DATA\n"
    assert not (fresh / "out" / "config.json").is_symlink()
    # a resumed run rewrites metrics.jsonl (cut back) into a file of its own, never through a link
    run = copy_run(base, tmp_path / "run")
    user.write_text((run / "out" / "metrics.jsonl").read_text())
    (run / "out" / "metrics.jsonl").unlink()
    (run / "out" / "metrics.jsonl").symlink_to(user)
    before = user.read_text()
    assert run_cli(["train", *write_config(world, run), *resume_args(run, iters=3)], capsys)[0] == 0
    assert user.read_text() == before
    assert not (run / "out" / "metrics.jsonl").is_symlink() and metrics_iterations(run) == [1, 2, 3]


def test_O13_moved_aside_symlink_is_removed_and_its_target_kept(world, tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.checkpoint import save_checkpoint

    user = tmp_path / "userdir"
    user.mkdir()
    (user / "f.txt").write_text("mine")
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "iter_0000001").symlink_to(user, target_is_directory=True)
    save_checkpoint(save, 1, AutoModelForCausalLM.from_pretrained(world / "model"))
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert not (save / "iter_0000001").is_symlink()
    assert tree(user) == ["f.txt"]


def test_demo_rerun_clears_only_its_own_checkpoints(tmp_path):
    from posttrain.demo.run import clear_own_checkpoints

    save = tmp_path / "ckpt"
    (save / "iter_0000001").mkdir(parents=True)
    (save / ".iter_0000002.tmp-1-ab").mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("1\n")
    (save / "NOTES.txt").write_text("mine")
    clear_own_checkpoints(save)
    assert tree(save) == ["NOTES.txt"]
