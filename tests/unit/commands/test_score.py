"""``posttrain score`` end to end (through the real argument parser)."""

import json

import pytest

from posttrain.cli import build_parser
from posttrain.errors import DataError
from posttrain.commands import score as score_cmd
from tests.helpers.runs import forbid, run_cli


def _run(argv):
    args = build_parser().parse_args(argv)
    return score_cmd.run(args)


def test_scores_lines_and_keeps_them_unchanged(tmp_path, capsys):
    rows = [{"response": "<answer>17</answer>", "label": "17", "id": 1},
            {"response": "the answer is 18.", "label": 17, "extra": [1, 2]},
            {"response": "\\boxed{17.0}", "label": "17"}]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    rc = _run(["score", "--verifier", "math_equiv", "--verifier", "answer_number",
               "--input", str(src), "--output", str(dst), "--parallel", "0"])
    assert rc == 0
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [{k: v for k, v in o.items() if k != "scores"} for o in out] == rows
    assert [o["scores"] for o in out] == [
        {"math_equiv": 1.0, "answer_number": 1.0},
        {"math_equiv": 0.0, "answer_number": 0.0},
        {"math_equiv": 1.0, "answer_number": 0.0},
    ]
    text = capsys.readouterr().out
    assert "scored 3 lines" in text and "math_equiv" in text and "0.6667" in text and "timeouts" in text


def test_field_names_can_be_overridden(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"completion": "#### 72", "answer": "72"}) + "\n")
    _run(["score", "--verifier", "gsm8k", "--input", str(src), "--output", str(dst),
          "--response-field", "completion", "--label-field", "answer", "--parallel", "0"])
    assert json.loads(dst.read_text())["scores"] == {"gsm8k": 1.0}


def test_bad_input_names_the_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"response": "x", "label": "1"}) + "\n" + json.dumps({"resp": "x"}) + "\n")
    with pytest.raises(DataError, match=r"in.jsonl:2: no field 'response'"):
        _run(["score", "--verifier", "gsm8k", "--input", str(src), "--output", str(tmp_path / "o.jsonl")])


# ---- hostile input and outputs (the reliability probe, docs/reliability.md) -------------------------
def test_non_utf8_input_names_the_file_and_line(tmp_path, capsys):
    """Probe R15: a non-UTF-8 byte in the input."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"response": "1", "label": "1"}\n{"response": "caf\xe9 1", "label": "1"}\n')
    code, err = run_cli(["score", "--verifier", "last_number", "--input", str(src),
                         "--output", str(tmp_path / "o.jsonl")], capsys)
    assert code == 2 and f"{src}:2: not valid UTF-8" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("parallel", ["0", "1"])
def test_lone_surrogate_is_written(tmp_path, capsys, parallel):
    """Probe R16: valid JSON holding a lone surrogate."""
    src, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    src.write_text('{"response": "\\udc80 the answer is 1", "label": "1"}\n')
    code, _ = run_cli(["score", "--verifier", "last_number", "--input", str(src), "--output", str(out),
                       "--parallel", parallel], capsys)
    assert code == 0
    row = json.loads(out.read_text())
    assert row["response"] == "\udc80 the answer is 1" and row["scores"] == {"last_number": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "o.jsonl"]  # no .tmp left


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_output_is_checked_before_the_work(tmp_path, capsys, monkeypatch, kind):
    """Probe R17: ``--output`` an existing directory or file."""
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


@pytest.mark.parametrize("flags,expect", [(["--verifier", "nosuch"], "--verifier nosuch: unknown verifier"),
                                          (["--verifier-module", "no_such_module_xyz"],
                                           "--verifier-module no_such_module_xyz: cannot import"),
                                          (["--parallel", "-1"], "--parallel -1: must be >= 0"),
                                          (["--timeout", "0"], "--timeout 0.0: must be a finite number of seconds > 0"),
                                          (["--timeout", "-5"], "--timeout -5.0: must be"),
                                          (["--timeout", "nan"], "--timeout nan: must be")],
                         ids=["R18_verifier", "R18_module", "R19_parallel", "R19_timeout_0", "R19_timeout_neg",
                              "R20_timeout_nan"])
def test_bad_flags_are_named(tmp_path, capsys, flags, expect):
    """Probes R18, R19, R20: an unknown verifier or module, ``--parallel -1``, a timeout of 0, below 0 or nan."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"response": "1", "label": "1"}) + "\n")
    code, err = run_cli(["score", "--verifier", "last_number", "--input", str(src),
                         "--output", str(tmp_path / "o.jsonl"), *flags], capsys)
    assert code == 2 and expect in err and "rl_config" not in err


def test_may_rewrite_its_input_in_place(tmp_path, capsys):
    """Probe R21: ``--output`` is the ``--input`` file."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"response": "1", "label": "1"}) + "\n")
    assert run_cli(["score", "--verifier", "last_number", "--input", str(src), "--output", str(src),
                    "--parallel", "0"], capsys)[0] == 0
    assert json.loads(src.read_text())["scores"] == {"last_number": 1.0}


# ---- probe 3 (docs/reliability/probe3_cmds.md) -------------------------------------------------------------
@pytest.mark.parametrize("text,message", [
    ("", "no rows (the file has no JSON object lines); nothing to score"),
    ('{"response": "3", "label": null}\n', ":1: the field 'label' is null"),
    ('{"response": "3", "response": "4", "label": "3"}\n', ":1: duplicate key 'response' in one object"),
    ('[{"response": "3", "label": "3"}]\n', ":1: the file is a JSON array, not JSON Lines"),
], ids=["CM17_empty", "CM19_null_label", "CM21_duplicate_key", "CM18_array"])
def test_input_that_cannot_be_scored_is_named(tmp_path, capsys, text, message):
    """Probes CM17, CM19, CM21, CM18: an empty input, a null label, a key written twice, a JSON
    array: refused, naming the file (and line), and nothing is written."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(text)
    code, err = run_cli(["score", "--verifier", "last_number", "--input", str(src), "--output", str(dst)], capsys)
    assert code == 2 and message in err and not dst.exists()


def test_a_full_disk_is_one_message_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """Probes I6, CM53: the disk fills while the scored rows are written (after the work): one message
    naming --output, no temporary left; a disk already full is found before the scoring."""
    import errno

    src, dst = tmp_path / "in.jsonl", tmp_path / "out" / "scored.jsonl"
    src.write_text(json.dumps({"response": "3", "label": "3"}) + "\n")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("posttrain.commands.score._json_line", full)
    code, err = run_cli(["score", "--verifier", "last_number", "--input", str(src), "--output", str(dst)], capsys)
    assert code == 2 and f"error: {dst}: cannot write it (the disk is full" in err
    assert list(dst.parent.iterdir()) == []
    monkeypatch.setattr("posttrain.commands.outputs.os.write", full)
    forbid(monkeypatch, "posttrain.commands.score:score_rows")
    code, err = run_cli(["score", "--verifier", "last_number", "--input", str(src), "--output",
                         str(tmp_path / "new" / "x.jsonl")], capsys)
    assert code == 2 and f"--output {tmp_path / 'new' / 'x.jsonl'}: cannot write in" in err and "disk is full" in err
    assert not (tmp_path / "new").exists()
