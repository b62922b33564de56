"""``posttrain eval`` (commands/eval.py): a bad model file or flag is named, the outputs are checked
before the work, and ``--samples`` holds every response. The cases of the reliability probe
(docs/reliability.md); each docstring names its probe id."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runs import forbid, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


def test_truncated_safetensors_names_the_file(mini_world, tmp_path, capsys):
    """Probe X8: ``--model`` a directory whose model.safetensors is truncated."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(mini_world / "model", model)
    with open(model / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    code, err = run_cli(["eval", "--model", str(model), "--data", str(mini_world / "data" / "rl")], capsys)
    assert code == 2 and f"{model / 'model.safetensors'}: not a readable safetensors file" in err


@pytest.mark.parametrize("flags,flag", [(["--max-tokens", "0"], "--max-tokens 0"),
                                        (["--temperature", "-1"], "--temperature -1"),
                                        (["--temperature", "nan"], "--temperature nan"),
                                        (["--dtype", "int8"], "--dtype int8"),
                                        (["--verifier", "nosuch"], "--verifier nosuch"),
                                        (["--limit", "0"], "--limit 0"),  # X11
                                        (["--max-tokens", "1000000000"], "--max-tokens 1000000000")],  # X12
                         ids=["X10_max_tokens", "X10_temperature", "X10_temperature_nan", "X10_dtype",
                              "X10_verifier", "X11_limit_0", "X12_max_tokens_huge"])
def test_bad_flags_are_named(mini_world, capsys, flags, flag):
    """Probes X10, X11, X12: a flag out of range, an unknown dtype or verifier, more new tokens than the
    model has positions."""
    code, err = run_cli(["eval", "--model", str(mini_world / "model"), "--data", str(mini_world / "data" / "rl"),
                         *flags], capsys)
    assert code == 2 and f"error: {flag}" in err
    assert "generate_config" not in err and "rl_config" not in err
    if "1000000000" in flag:
        assert "max_position_embeddings 256" in err


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_output_is_checked_before_the_work(mini_world, tmp_path, capsys, monkeypatch, kind):
    """Probe X13: ``--output`` an existing directory or file."""
    out = tmp_path / "res.json"
    out.mkdir() if kind == "dir" else out.write_text("mine")
    forbid(monkeypatch, "posttrain.models.loading:load_causal_lm")
    code, err = run_cli(["eval", "--model", str(mini_world / "model"), "--data", str(mini_world / "data" / "rl"),
                         "--output", str(out)], capsys)
    assert code == 2 and f"--output {out}" in err
    assert ("is an existing directory" in err) if kind == "dir" else ("already exists" in err and "--force" in err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json"]  # no .tmp left


def test_force_replaces_the_output(mini_world, tmp_path, capsys):
    """Probe X13: ``--force`` on an existing ``--output``."""
    out = tmp_path / "res.json"
    out.write_text("old")
    code, _ = run_cli(["eval", "--model", str(mini_world / "model"), "--data", str(mini_world / "data" / "rl"),
                       "--output", str(out), "--force", "--limit", "2", "--max-tokens", "2"], capsys)
    assert code == 0 and json.loads(out.read_text())["num_prompts"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.json"]


def test_samples_file_holds_every_response(mini_world, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    samples.write_text("old")
    argv = ["eval", "--model", str(mini_world / "model"), "--data", str(mini_world / "data" / "rl"), "--limit", "2",
            "--max-tokens", "2", "--n", "2", "--temperature", "1", "--samples", str(samples)]
    code, err = run_cli(argv, capsys)
    assert code == 2 and f"--samples {samples}" in err and samples.read_text() == "old"
    assert run_cli([*argv, "--force"], capsys)[0] == 0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert [(r["prompt"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(isinstance(r["response"], str) and r["score"] in (0.0, 1.0) for r in rows)


# ---- probe 3 (docs/reliability/probe3_cmds.md) -------------------------------------------------------------
def _jsonl(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _eval(world, data, capsys, *flags):
    return run_cli(["eval", "--model", str(world / "model"), "--data", str(data), "--max-tokens", "2", *flags], capsys)


def test_empty_prompts_are_skipped_named_and_counted(mini_world, tmp_path, capsys):
    """Probe G5 (and CM16): an empty prompt is skipped with a line naming the row, as preprocess
    does, and counted; when every row is skipped, nothing is evaluated."""
    data = _jsonl(tmp_path / "d.jsonl", {"problem": "", "answer": "1"}, {"problem": "1+2", "answer": "3"})
    out = tmp_path / "res.json"
    code, err = _eval(mini_world, data, capsys, "--output", str(out))
    assert code == 0 and f"skip {data}:1: empty prompt" in err
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 1 and result["skipped"] == {"empty prompt": 1}
    _jsonl(data, {"problem": " ", "answer": "1"})
    code, err = _eval(mini_world, data, capsys)
    assert code == 2 and f"--data {data}: no prompts (skipped: {{'empty prompt': 1}})" in err


@pytest.mark.parametrize("row,message", [
    ({"prompt": "1+1", "label": None}, "the label field 'label' is null"),
    ({"problem": None, "answer": "2"}, "the prompt field 'problem' is null"),
    ({"problem": "1+1", "answer": ["2"]}, "the label field 'answer' is a list"),
    ('{"problem": "1+1", "problem": "2+2", "answer": "2"}', "duplicate key 'problem'"),
], ids=["G6_null_label", "CM8_null_prompt", "CM6_list_label", "CM5_duplicate_key"])
def test_a_bad_row_is_named_before_the_model_loads(mini_world, tmp_path, capsys, monkeypatch, row, message):
    """Probes G6, CM8, CM6, CM5: a null label or prompt is called null (not missing), a label that
    is a list is refused, a key written twice is refused; each before the model loads."""
    data = _jsonl(tmp_path / "d.jsonl", row)
    forbid(monkeypatch, "posttrain.commands.eval:load_merged")
    code, err = _eval(mini_world, data, capsys)
    assert code == 2 and f"{data}:1: {message}" in err


@pytest.mark.parametrize("case", ["G9", "G11b", "G11c", "CM11", "CM12"])
def test_no_output_replaces_an_input_or_another_output(mini_world, tmp_path, capsys, monkeypatch, case):
    """Probes G9 (--samples = --output), G11b / G11c (--samples / --output = --data, with --force),
    CM11 (--output a symlink to --data) and CM12 (--output a file of --model): refused before the
    work, with or without --force, and the input is unchanged."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(mini_world / "model", model)
    data = _jsonl(tmp_path / "d.jsonl", {"problem": "1+2", "answer": "3"})
    (tmp_path / "link.json").symlink_to(data)
    flags = {"G9": ["--samples", str(tmp_path / "same.json"), "--output", str(tmp_path / "same.json")],
             "G11b": ["--samples", str(data), "--force"], "G11c": ["--output", str(data), "--force"],
             "CM11": ["--output", str(tmp_path / "link.json"), "--force"],
             "CM12": ["--output", str(model / "config.json"), "--force"]}[case]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    forbid(monkeypatch, "posttrain.commands.eval:load_merged")
    code, err = run_cli(["eval", "--model", str(model), "--data", str(data), *flags], capsys)
    assert code == 2 and ("name the same file" if case == "G9" else "which this command reads") in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_prompts_longer_than_the_context_are_skipped_before_tokenizing_them(mini_world, tmp_path, capsys, monkeypatch):
    """Probes G14, G14b, G14c, CM15: a prompt that cannot fit in the model's 256 positions with
    --max-tokens is skipped with a line naming the row; one with more characters than the context
    can hold is never tokenized."""
    from posttrain.data.encoding import TemplateEncoder

    data = _jsonl(tmp_path / "d.jsonl", {"problem": "1+" * 400_000, "answer": "1"},
                  {"problem": "1 + " * 200, "answer": "1"}, {"problem": "1+2", "answer": "3"})
    real = TemplateEncoder.encode_prompt

    def encode(self, text, *a, **k):
        assert len(text) < 100_000, "a prompt that cannot fit was tokenized whole"
        return real(self, text, *a, **k)

    monkeypatch.setattr(TemplateEncoder, "encode_prompt", encode)
    code, err = _eval(mini_world, data, capsys)
    assert code == 0 and f"skip {data}:1: the prompt has 800,000 characters" in err
    assert f"skip {data}:2: the prompt is " in err and "model's context of 256 positions" in err


def test_max_tokens_that_fill_the_context_and_a_missing_prefix_are_named(mini_world, tmp_path, capsys):
    """Probes CM13 (--max-tokens = the context: no room for the prompt) and CM14 (--data a prefix
    with no files is named by its flag, not a config key)."""
    code, err = _eval(mini_world, mini_world / "data" / "rl", capsys, "--max-tokens", "256")
    assert code == 2 and "--max-tokens 256: leaves no room for the prompt" in err
    code, err = _eval(mini_world, tmp_path / "nosuch", capsys)
    assert code == 2 and f"error: --data {tmp_path / 'nosuch'}: no files" in err


def test_a_full_disk_is_one_message_and_leaves_nothing(mini_world, tmp_path, capsys, monkeypatch):
    """Probe I7: the disk fills while the results are written (after the work): one message naming
    the file, no temporary left; and a disk already full is found before the work."""
    import errno
    import os

    out = tmp_path / "res.json"

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    real_fdopen = os.fdopen

    class FullFile:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("posttrain.commands.outputs.os.fdopen", lambda fd, mode: FullFile(real_fdopen(fd, mode)))
    code, err = _eval(mini_world, mini_world / "data" / "rl", capsys, "--limit", "1", "--output", str(out))
    assert code == 2 and f"error: {out}: cannot write it (the disk is full" in err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr("posttrain.commands.outputs.os.write", full)
    forbid(monkeypatch, "posttrain.commands.eval:load_merged")
    code, err = _eval(mini_world, mini_world / "data" / "rl", capsys, "--output", str(tmp_path / "new" / "res.json"))
    assert code == 2 and "cannot write in" in err and "the disk is full" in err
    assert list(tmp_path.iterdir()) == []  # the folder it created for the output is gone again
