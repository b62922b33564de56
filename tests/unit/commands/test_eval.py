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
