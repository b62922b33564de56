"""Reliability probe, checkpoints (docs: /work/shared/reviews/reliability_probe.md sections 1.3, 3):
a corrupt file of the checkpoint a run resumes from is a CheckpointError naming the file (exit 2)
and the previous complete checkpoint, ``--load-previous-on-corruption`` falls back to it, a missing
sampler.pt is an error, and a non-finite loss or weight never becomes a checkpoint."""

from __future__ import annotations

import json
import logging
import math
import struct

import pytest
import torch

from reliability_world import (  # noqa: F401  (fixtures)
    base, copy_run, metrics_iterations, one_thread, resume_args, run_config, world, write_config)

pytestmark = pytest.mark.usefixtures("one_thread")


def run_cli(argv, capsys):
    from posttrain.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


def damaged(base, tmp_path, world, damage):
    """Copy the base run, apply ``damage(iter_0000002 dir)``, return the CLI args that resume it."""
    run = copy_run(base, tmp_path / "run")
    damage(run / "ckpt" / "iter_0000002")
    return run, write_config(world, run) + resume_args(run)


def _truncate(size):
    def damage(path):
        with open(path / "model.safetensors", "r+b") as f:
            f.truncate(size)
    return damage


def _header_garbage(path):
    with open(path / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"XXXXXXXXXX")


@pytest.mark.parametrize("damage", [_truncate(100_000), _truncate(0), _header_garbage],
                         ids=["truncated", "empty", "header_garbage"])
def test_K7_K8_corrupt_safetensors_names_the_file(base, world, tmp_path, capsys, damage):
    run, argv = damaged(base, tmp_path, world, damage)
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2
    assert "iter_0000002/model.safetensors" in err and "truncated or corrupt" in err
    assert "previous complete checkpoint" in err and "iter_0000001" in err
    assert "--load-previous-on-corruption" in err
    assert not (run / "ckpt" / "iter_0000003").exists()


def test_K9_nan_weights_are_refused_naming_the_tensor(base, world, tmp_path, capsys):
    def damage(path):
        data = bytearray((path / "model.safetensors").read_bytes())
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        name, entry = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                             key=lambda kv: kv[1]["data_offsets"][0])[1]
        start = 8 + n + entry["data_offsets"][0]
        data[start:start + 64] = b"\xff" * 64  # float32 0xffffffff is NaN
        (path / "model.safetensors").write_bytes(bytes(data))
        damage.name = name

    run, argv = damaged(base, tmp_path, world, damage)
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2
    assert "iter_0000002/model.safetensors" in err and f"tensor {damage.name}" in err and "NaN/inf" in err


@pytest.mark.parametrize("text,why", [("garbage{{{", "not valid JSON"), ('{"iteration": "two"}', "iteration must be"),
                                      ("[1, 2]", "expected a JSON object")], ids=["garbage", "two", "list"])
def test_K12_corrupt_trainer_state_names_the_file(base, world, tmp_path, capsys, text, why):
    run, argv = damaged(base, tmp_path, world, lambda p: (p / "trainer_state.json").write_text(text))
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and "iter_0000002/trainer_state.json" in err and why in err and "iter_0000001" in err


def test_K15_corrupt_config_json_names_the_file(base, world, tmp_path, capsys):
    run, argv = damaged(base, tmp_path, world, lambda p: (p / "config.json").write_text("xx"))
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and "iter_0000002/config.json: not valid JSON" in err and "iter_0000001" in err


@pytest.mark.parametrize("name,content", [("optimizer.pt", "random"), ("optimizer.pt", "truncated"),
                                          ("scheduler.pt", "random"), ("rng.pt", "x"), ("sampler.pt", "random")])
def test_K16_K18_corrupt_torch_files_name_the_file(base, world, tmp_path, capsys, name, content):
    def damage(path):
        if content == "truncated":
            with open(path / name, "r+b") as f:
                f.truncate(2000)
        else:
            (path / name).write_bytes(b"x" if content == "x" else torch.randint(0, 256, (5000,), dtype=torch.uint8)
                                      .numpy().tobytes())

    run, argv = damaged(base, tmp_path, world, damage)
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and f"iter_0000002/{name}: cannot be read" in err and "iter_0000001" in err


def test_K7_load_previous_on_corruption_falls_back_and_warns(base, world, tmp_path, capsys, caplog):
    run, argv = damaged(base, tmp_path, world, _truncate(1000))
    with caplog.at_level(logging.WARNING):
        code, _ = run_cli(["train", *argv, "--load-previous-on-corruption"], capsys)
    assert code == 0
    warning = [r.getMessage() for r in caplog.records if "--load-previous-on-corruption" in r.getMessage()]
    assert warning and "iter_0000002" in warning[0] and "iter_0000001" in warning[0]
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    from safetensors.torch import load_file

    load_file(str(run / "ckpt" / "iter_0000002" / "model.safetensors"))  # re-saved whole
    assert metrics_iterations(run) == [1, 2, 3]  # the rows after iteration 1 were logged again, once


def test_K13_load_previous_on_corruption_when_the_tracker_names_a_broken_dir(base, world, tmp_path, capsys):
    run, argv = damaged(base, tmp_path, world, lambda p: (p / "trainer_state.json").unlink())
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and "iter_0000002 is missing or incomplete" in err and "iter_0000001 exists" in err
    code, _ = run_cli(["train", *argv, "--load-previous-on-corruption"], capsys)
    assert code == 0 and (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_K11_missing_sampler_is_an_error_unless_no_load_rng(base, world, tmp_path, capsys, caplog):
    run, argv = damaged(base, tmp_path, world, lambda p: (p / "sampler.pt").unlink())
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and "iter_0000002/sampler.pt is missing" in err and "no_load_rng: true" in err
    with caplog.at_level(logging.WARNING):
        code, _ = run_cli(["train", *argv, "actor_config.no_load_rng=true"], capsys)
    assert code == 0
    assert any("sampler.pt is missing" in r.getMessage() and "restarts" in r.getMessage() for r in caplog.records)


# ---- a non-finite loss, learning rate or weight never becomes a checkpoint -----------------------
@pytest.mark.parametrize("key,value", [("lr", math.inf), ("weight_decay", math.nan)], ids=["C35_lr_inf", "C36_wd_nan"])
def test_C35_C36_non_finite_hyperparameter_stops_before_any_update_or_save(world, tmp_path, key, value):
    from posttrain.config.plan import resolve_plan
    from posttrain.trainers.stages import build_trainer, run_dir_for
    from posttrain.train.engine import NaNLossError

    cfg = run_config(world, tmp_path / "run", iters=2)  # the config refuses inf / nan; they are forced in here
    trainer = build_trainer(cfg, resolve_plan(cfg), run_dir_for(cfg))
    model = trainer.s.policy.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for group in trainer.s.policy.actor.optimizer.param_groups:
        group[key] = value
    with pytest.raises(NaNLossError, match=f"optimizer's {key} is"):
        trainer.fit()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "run" / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    assert not list((tmp_path / "run" / "ckpt").glob("iter_*"))


def test_C35_non_finite_update_metric_stops_before_save(world, tmp_path, capsys, monkeypatch):
    from posttrain.train.engine import TrainEngine

    real = TrainEngine.update

    def update(self, *args, **kwargs):
        steps = real(self, *args, **kwargs)
        return [{**s, "actor/lr": math.inf} for s in steps]

    monkeypatch.setattr(TrainEngine, "update", update)
    run = tmp_path / "run"
    code, err = run_cli(["train", *write_config(world, run)], capsys)
    assert code == 2 and "non-finite training metric at iteration 1: actor/lr=inf" in err
    assert not list((run / "ckpt").glob("iter_*"))


def test_C35_session_refuses_to_save_nan_weights(world, tmp_path, capsys, monkeypatch):
    from posttrain.train.engine import TrainEngine

    real = TrainEngine.update

    def update(self, *args, **kwargs):
        steps = real(self, *args, **kwargs)
        with torch.no_grad():
            next(self.model.parameters()).fill_(math.nan)  # finite metrics, NaN weights
        return steps

    monkeypatch.setattr(TrainEngine, "update", update)
    run = tmp_path / "run"
    code, err = run_cli(["train", *write_config(world, run)], capsys)
    assert code == 2 and "holds NaN/inf at iteration 1" in err and "not saved" in err
    assert not list((run / "ckpt").glob("iter_*"))


def test_C66_keep_last_keeps_the_newest_checkpoints(world, tmp_path):
    """``actor_config.keep_last`` (documented in docs/checkpoints.md) is a real key: after each save
    only the newest N ``iter_*`` directories stay."""
    from posttrain.trainers.stages import train

    run = tmp_path / "keep"
    train(run_config(world, run, iters=3, actor_config={"save": str(run / "ckpt"), "keep_last": 2}))
    assert sorted(p.name for p in (run / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
