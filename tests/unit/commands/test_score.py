"""``posttrain score`` end to end (through the real argument parser)."""

import json

import pytest

from posttrain.cli import build_parser
from posttrain.errors import DataError
from posttrain.commands import score as score_cmd


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
