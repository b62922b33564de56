"""``posttrain init-model`` (commands/init_model.py, models/init_model.py) never deletes or overwrites
what it did not write, and names a bad flag: the cases of the reliability probe (docs/reliability.md),
each docstring naming its probe id."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import forbid, run_cli, tree


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
def test_refuses_a_nonempty_output(tmp_path, capsys, monkeypatch, make):
    """Probes O1, O2: ``--output`` an existing checkpoint directory or a run directory."""
    target = tmp_path / "target"
    make(target)
    before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
    forbid(monkeypatch, "posttrain.models.init_model:train_tokenizer")
    code, err = run_cli(["init-model", "--output", str(target)], capsys)
    assert code == 2 and f"--output {target} is not empty" in err and "--force" in err
    assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before


def test_force_replaces_only_its_own_files(tmp_path, capsys):
    """Probe O1: ``--force`` on a checkpoint directory."""
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


def test_refuses_the_current_directory(tmp_path, capsys, monkeypatch):
    """Probe O3: ``--output .``, its parent, or its absolute path, with or without ``--force``."""
    (tmp_path / "important.txt").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f.txt").write_text("b")
    monkeypatch.chdir(tmp_path / "sub")
    for output in (".", "..", str(tmp_path)):
        for extra in ([], ["--force"]):
            code, err = run_cli(["init-model", "--output", output, *extra], capsys)
            assert code == 2 and "is the current directory" in err
    assert tree(tmp_path) == ["important.txt", "sub", "sub/f.txt"]


def test_refuses_an_output_that_is_a_file(tmp_path, capsys):
    """Probe O4: ``--output`` an existing file."""
    (tmp_path / "afile").write_text("x")
    code, err = run_cli(["init-model", "--output", str(tmp_path / "afile")], capsys)
    assert code == 2 and "is an existing file" in err and (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("flags,expect", [(["--vocab-size", "-1"], "--vocab-size -1: must be at least 259"),
                                          (["--vocab-size", "0"], "--vocab-size 0: must be at least 259"),
                                          (["--vocab-size", "5"], "--vocab-size 5: must be at least 259"),
                                          (["--tokenizer", "/nonexistent"],
                                           "--tokenizer /nonexistent: no such directory"),
                                          (["--tokenizer", "EMPTY"], "cannot load a tokenizer")],
                         ids=["X19_vocab_negative", "X20_vocab_0", "X20_vocab_5", "X19_tokenizer_missing",
                              "X19_tokenizer_empty_dir"])
def test_bad_flags_are_named(tmp_path, capsys, flags, expect):
    """Probes X19, X20: a vocabulary below 259 tokens, a missing or empty ``--tokenizer`` directory."""
    (tmp_path / "empty").mkdir()
    flags = [str(tmp_path / "empty") if f == "EMPTY" else f for f in flags]
    code, err = run_cli(["init-model", "--output", str(tmp_path / "m"), *flags], capsys)
    assert code == 2 and expect in err and not (tmp_path / "m").exists()


# ---- probe 3 (docs/reliability/probe3_cmds.md) -------------------------------------------------------------
def test_a_model_written_there_meanwhile_is_not_replaced(tmp_path, capsys, monkeypatch):
    """Probe Q3: another init-model fills the new --output while this one builds its model: this one
    refuses and writes nothing (before, both said "wrote" and one model silently replaced the other)."""
    import posttrain.models.init_model as im

    out = tmp_path / "m"
    real = im.make_readable

    def other_process_wins(path):
        out.mkdir()
        (out / "config.json").write_text("the other model")
        return real(path)

    monkeypatch.setattr(im, "make_readable", other_process_wins)
    code, err = run_cli(["init-model", "--output", str(out)], capsys)
    assert code == 2 and f"--output {out}: another process wrote into it" in err
    assert tree(tmp_path) == ["m", "m/config.json"] and (out / "config.json").read_text() == "the other model"


@pytest.mark.parametrize("yaml_text,expect", [
    ("odd:\n  num_layers: 1\n  hidden_size: 100\n  num_attention_heads: 3\n",
     "model 'odd': hidden_size=100 is not a multiple of num_attention_heads=3"),
    ("zero:\n  num_layers: 1\n  hidden_size: 0\n  num_attention_heads: 1\n", "model 'zero': hidden_size=0 must be"),
    ("gqa:\n  num_layers: 1\n  hidden_size: 64\n  num_attention_heads: 4\n  group_query_attention: true\n"
     "  num_query_groups: 3\n", "num_attention_heads=4 is not a multiple of num_query_groups=3"),
], ids=["CM35_heads", "CM36_zero", "CM35_groups"])
def test_sizes_that_build_no_model_are_named(tmp_path, capsys, monkeypatch, yaml_text, expect):
    """Probes CM35, CM36: a model yaml whose sizes no model has (Transformers' traceback before)."""
    (tmp_path / "m.yaml").write_text(yaml_text)
    forbid(monkeypatch, "posttrain.models.init_model:train_tokenizer")
    code, err = run_cli(["init-model", "--model", str(tmp_path / "m.yaml"), "--output", str(tmp_path / "out")], capsys)
    assert code == 2 and expect in err and not (tmp_path / "out").exists()


def test_a_full_disk_is_one_message_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """Probe CM37: the disk fills while the model is saved: one message naming --output, no
    temporary directory left; a disk already full is found before the model is built."""
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("transformers.PreTrainedModel.save_pretrained", full)
    code, err = run_cli(["init-model", "--output", str(tmp_path / "m")], capsys)
    assert code == 2 and f"--output {tmp_path / 'm'}: cannot write the model (the disk is full)" in err
    assert tree(tmp_path) == []
    monkeypatch.setattr("posttrain.commands.outputs.os.write", full)
    forbid(monkeypatch, "posttrain.models.init_model:train_tokenizer")
    code, err = run_cli(["init-model", "--output", str(tmp_path / "a" / "m")], capsys)
    assert code == 2 and "the disk is full" in err and tree(tmp_path) == []
