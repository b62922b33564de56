"""The session's checkpoints (loops/session.py, checkpoint.py): a run resumes only from a
checkpoint it can read. A corrupt file of the checkpoint a run resumes from is a CheckpointError naming
the file and the previous complete checkpoint (exit 2), ``--load-previous-on-corruption`` falls back
to it, a missing sampler.pt is an error, a non-finite loss, learning rate or weight never becomes a
checkpoint, and ``keep_last`` prunes the older ones.

The cases of the reliability probe (docs/reliability.md); each docstring names its probe id."""

from __future__ import annotations

import json
import logging
import math
import struct

import pytest
import torch

from tests.helpers.runs import copy_run, metrics_iterations, resume_args, run_cli, world_run_config, write_config

pytestmark = pytest.mark.usefixtures("one_thread")


def damaged(base_run, tmp_path, mini_world, damage):
    """Copy the base run, apply ``damage(iter_0000002 dir)``, return the CLI args that resume it."""
    run = copy_run(base_run, tmp_path / "run")
    damage(run / "ckpt" / "iter_0000002")
    return run, write_config(mini_world, run) + resume_args(run)


def _truncate(size):
    def damage(path):
        with open(path / "model.safetensors", "r+b") as f:
            f.truncate(size)
    return damage


def _header_garbage(path):
    with open(path / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"XXXXXXXXXX")


# ---- a damaged checkpoint is named, and the previous complete one offered -------------------------
@pytest.mark.parametrize("damage", [_truncate(100_000), _truncate(0), _header_garbage],
                         ids=["truncated", "empty", "header_garbage"])
def test_corrupt_safetensors_names_the_file_and_the_previous_checkpoint(base_run, mini_world, tmp_path, capsys,
                                                                         damage):
    """Probes K7, K8: the latest model.safetensors truncated, empty or with a garbled header."""
    run, argv = damaged(base_run, tmp_path, mini_world, damage)
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2
    assert "iter_0000002/model.safetensors" in err and "truncated or corrupt" in err
    assert "previous complete checkpoint" in err and "iter_0000001" in err
    assert "--load-previous-on-corruption" in err
    assert not (run / "ckpt" / "iter_0000003").exists()


def test_nan_weights_are_refused_naming_the_tensor(base_run, mini_world, tmp_path, capsys):
    """Probe K9: 64 weight bytes of the latest checkpoint set to 0xff (NaN)."""

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

    run, argv = damaged(base_run, tmp_path, mini_world, damage)
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2
    assert "iter_0000002/model.safetensors" in err and f"tensor {damage.name}" in err and "NaN/inf" in err


@pytest.mark.parametrize("text,why", [("garbage{{{", "not valid JSON"), ('{"iteration": "two"}', "iteration must be"),
                                      ("[1, 2]", "expected a JSON object")], ids=["garbage", "two", "list"])
def test_corrupt_trainer_state_names_the_file(base_run, mini_world, tmp_path, capsys, text, why):
    """Probe K12: trainer_state.json is garbage, has a string iteration, or is a list."""
    run, argv = damaged(base_run, tmp_path, mini_world, lambda p: (p / "trainer_state.json").write_text(text))
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and "iter_0000002/trainer_state.json" in err and why in err and "iter_0000001" in err


def test_corrupt_config_json_names_the_file(base_run, mini_world, tmp_path, capsys):
    """Probe K15: the checkpoint's config.json is ``xx``."""
    run, argv = damaged(base_run, tmp_path, mini_world, lambda p: (p / "config.json").write_text("xx"))
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and "iter_0000002/config.json: not valid JSON" in err and "iter_0000001" in err


@pytest.mark.parametrize("name,content", [("optimizer.pt", "random"), ("optimizer.pt", "truncated"),
                                          ("scheduler.pt", "random"), ("rng.pt", "x"), ("sampler.pt", "random")])
def test_corrupt_torch_files_name_the_file(base_run, mini_world, tmp_path, capsys, name, content):
    """Probes K16, K18: optimizer.pt, scheduler.pt, rng.pt or sampler.pt hold random bytes or are cut short."""

    def damage(path):
        if content == "truncated":
            with open(path / name, "r+b") as f:
                f.truncate(2000)
        else:
            (path / name).write_bytes(b"x" if content == "x" else torch.randint(0, 256, (5000,), dtype=torch.uint8)
                                      .numpy().tobytes())

    run, argv = damaged(base_run, tmp_path, mini_world, damage)
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and f"iter_0000002/{name}: cannot be read" in err and "iter_0000001" in err


@pytest.mark.parametrize("name", ["in_flight.pt", "partial_rollout.pt"])
def test_a_truncated_source_file_is_named_before_the_model_is_built(base_run, mini_world, tmp_path, capsys, caplog,
                                                                    name):
    """Probes KN1, RN10: a truncated in_flight.pt / partial_rollout.pt in the latest checkpoint is named
    (with the previous checkpoint) before any model is built, and --load-previous-on-corruption falls
    back to the previous complete checkpoint."""
    def damage(path):
        torch.save({"data": torch.zeros(1000)}, path / name)
        with open(path / name, "r+b") as f:
            f.truncate(2000)

    run, argv = damaged(base_run, tmp_path, mini_world, damage)
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and f"iter_0000002/{name}: cannot be read" in err and "iter_0000001 exists" in err
    with caplog.at_level(logging.WARNING):
        code, _ = run_cli(["train", *argv, "--load-previous-on-corruption"], capsys)
    assert code == 0 and metrics_iterations(run) == [1, 2, 3]


def test_load_previous_on_corruption_falls_back_and_warns(base_run, mini_world, tmp_path, capsys, caplog):
    """Probe K7: ``--load-previous-on-corruption`` after a truncated model.safetensors."""
    run, argv = damaged(base_run, tmp_path, mini_world, _truncate(1000))
    with caplog.at_level(logging.WARNING):
        code, _ = run_cli(["train", *argv, "--load-previous-on-corruption"], capsys)
    assert code == 0
    warning = [r.getMessage() for r in caplog.records if "--load-previous-on-corruption" in r.getMessage()]
    assert warning and "iter_0000002" in warning[0] and "iter_0000001" in warning[0]
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    from safetensors.torch import load_file

    load_file(str(run / "ckpt" / "iter_0000002" / "model.safetensors"))  # re-saved whole
    assert metrics_iterations(run) == [1, 2, 3]  # the rows after iteration 1 were logged again, once


def test_tracker_naming_an_incomplete_checkpoint_is_refused_or_falls_back(base_run, mini_world, tmp_path, capsys):
    """Probe K13: the tracker names an iter_* directory without its trainer_state.json."""
    run, argv = damaged(base_run, tmp_path, mini_world, lambda p: (p / "trainer_state.json").unlink())
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and "iter_0000002 is missing or incomplete" in err and "iter_0000001 exists" in err
    code, _ = run_cli(["train", *argv, "--load-previous-on-corruption"], capsys)
    assert code == 0 and (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_missing_sampler_is_an_error_unless_no_load_rng(base_run, mini_world, tmp_path, capsys, caplog):
    """Probe K11: sampler.pt deleted."""
    run, argv = damaged(base_run, tmp_path, mini_world, lambda p: (p / "sampler.pt").unlink())
    code, err = run_cli(["train", *argv], capsys)
    assert code == 2 and "iter_0000002/sampler.pt is missing" in err and "no_load_rng: true" in err
    with caplog.at_level(logging.WARNING):
        code, _ = run_cli(["train", *argv, "actor_config.no_load_rng=true"], capsys)
    assert code == 0
    assert any("sampler.pt is missing" in r.getMessage() and "restarts" in r.getMessage() for r in caplog.records)


# ---- a non-finite loss, learning rate or weight never becomes a checkpoint -----------------------
@pytest.mark.parametrize("key,value", [("lr", math.inf), ("weight_decay", math.nan)], ids=["C35_lr_inf", "C36_wd_nan"])
def test_non_finite_hyperparameter_stops_before_any_update_or_save(mini_world, tmp_path, key, value):
    """Probes C35, C36: ``lr=inf`` or ``weight_decay=nan`` forced into the optimizer."""
    from posttrain.config.plan import resolve_plan
    from posttrain.loops.build import build_trainer
    from posttrain.training.engine import NaNLossError

    cfg = world_run_config(mini_world, tmp_path / "run", iters=2)  # the config refuses inf/nan: forced in here
    trainer = build_trainer(resolve_plan(cfg))
    model = trainer.s.policy.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for group in trainer.s.policy.actor.optimizer.param_groups:
        group[key] = value
    with pytest.raises(NaNLossError, match=f"optimizer's {key} is"):
        trainer.fit()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "run" / "ckpt" / "latest_checkpointed_iteration.txt").exists()
    assert not list((tmp_path / "run" / "ckpt").glob("iter_*"))


def test_non_finite_update_metric_stops_before_save(mini_world, tmp_path, capsys, monkeypatch):
    """Probe C35: an update that reports ``actor/lr=inf``."""
    from posttrain.training.engine import TrainEngine

    real = TrainEngine.update

    def update(self, *args, **kwargs):
        steps = real(self, *args, **kwargs)
        return [{**s, "actor/lr": math.inf} for s in steps]

    monkeypatch.setattr(TrainEngine, "update", update)
    run = tmp_path / "run"
    code, err = run_cli(["train", *write_config(mini_world, run)], capsys)
    assert code == 2 and "non-finite training metric at iteration 1: actor/lr=inf" in err
    assert not list((run / "ckpt").glob("iter_*"))


def test_nan_weights_are_never_saved(mini_world, tmp_path, capsys, monkeypatch):
    """Probe C35: an update that leaves NaN weights behind finite metrics."""
    from posttrain.training.engine import TrainEngine

    real = TrainEngine.update

    def update(self, *args, **kwargs):
        steps = real(self, *args, **kwargs)
        with torch.no_grad():
            next(self.model.parameters()).fill_(math.nan)  # finite metrics, NaN weights
        return steps

    monkeypatch.setattr(TrainEngine, "update", update)
    run = tmp_path / "run"
    code, err = run_cli(["train", *write_config(mini_world, run)], capsys)
    assert code == 2 and "holds NaN/inf at iteration 1" in err and "not saved" in err
    assert not list((run / "ckpt").glob("iter_*"))


def test_keep_last_keeps_the_newest_checkpoints(mini_world, tmp_path):
    """Probe C66: ``actor_config.keep_last`` (documented in docs/checkpoints.md) is a real key: after each save
    only the newest N ``iter_*`` directories stay."""
    from posttrain.commands.train import train_config as train

    run = tmp_path / "keep"
    train(world_run_config(mini_world, run, iters=3, actor_config={"save": str(run / "ckpt"), "keep_last": 2}))
    assert sorted(p.name for p in (run / "ckpt").glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
