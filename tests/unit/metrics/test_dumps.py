"""Accuracy dumps (posttrain.metrics.dumps) and their comparison (posttrain.metrics.dump_compare):
statistics checked by hand, the step window and token range of the recorder, and the first
difference of two dumps."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.metrics.dump_compare import DumpError, close, first_difference, load_dump
from posttrain.metrics import dumps
from posttrain.metrics.dumps import DumpOptions, DumpRecorder, tensor_stats


@pytest.mark.parametrize("chunk", [1 << 22, 2])  # in one piece, and two elements at a time
def test_tensor_stats_by_hand(chunk, monkeypatch):
    monkeypatch.setattr(dumps, "CHUNK", chunk)
    s = tensor_stats(torch.tensor([3.0, -4.0, float("nan"), float("inf"), 0.0]))
    # the finite values 3, -4, 0: max 3, min -4, mean -1/3, norm 5; one NaN, one inf
    assert s == {"max": 3.0, "min": -4.0, "mean": pytest.approx(-1 / 3), "norm": 5.0, "nan": 1, "inf": 1,
                 "numel": 5}
    assert tensor_stats(torch.tensor([float("nan")])) == {"max": None, "min": None, "mean": None, "norm": None,
                                                         "nan": 1, "inf": 0, "numel": 1}


def _tiny_step(recorder: DumpRecorder, model, iteration: int, x) -> None:
    with recorder.step(iteration):
        recorder.record("key_data", "advantages", x)
        with recorder.watch("rollout", lambda: [model]):
            for _ in range(3):  # three "decode" calls: 0, 1, 2
                model(x)


def test_recorder_window_token_range_and_files(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    options = DumpOptions(dump_path=str(tmp_path / "d"), roles=frozenset({"key_data", "actor_infer"}),
                          step_start=2, step_end=2, token_start=1, token_end=1)
    recorder = DumpRecorder(options)
    (tmp_path / "d/step_2/rank_0").mkdir(parents=True)
    (tmp_path / "d/step_2/rank_0/reference.jsonl").write_text("an earlier run's role\n")
    x = torch.randn(2, 4)
    for iteration in (1, 2, 3):
        _tiny_step(recorder, model, iteration, x)
    assert sorted(p.relative_to(tmp_path / "d").as_posix() for p in recorder.written) == [
        "step_2/rank_0/actor_infer.jsonl", "step_2/rank_0/key_data.jsonl"]  # only step 2
    assert not (tmp_path / "d/step_2/rank_0/reference.jsonl").exists()  # not this run's: removed
    rows = [json.loads(line) for line in (tmp_path / "d/step_2/rank_0/actor_infer.jsonl").read_text().splitlines()]
    assert {r["call"] for r in rows} == {1}  # the token range: call 1 alone
    # post-order: the Linear, then the ReLU, then the whole model; each its input then its output
    assert [(r["name"], r["tensor"]) for r in rows] == [
        ("0", "input.0"), ("0", "output"), ("1", "input.0"), ("1", "output"), ("Sequential", "input.0"),
        ("Sequential", "output")]
    linear_out = model[0](x).detach()
    assert rows[1]["max"] == pytest.approx(float(linear_out.max())) and rows[1]["shape"] == [2, 3]
    assert [r["seq"] for r in rows] == list(range(1, 7))  # after the key data record (seq 0)


def _dump(tmp_path, name, values):
    folder = tmp_path / name / "step_1" / "rank_0"
    folder.mkdir(parents=True)
    rows = [{"seq": i, "step": 1, "role": "actor_infer", "phase": "rollout", "name": f"m{i}", "tensor": "output",
             "call": 0, "shape": [1], "dtype": "float32", **tensor_stats(torch.tensor([v]))}
            for i, v in enumerate(values)]
    (folder / "actor_infer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path / name


def test_first_difference_tolerance_and_order(tmp_path, capsys):
    a = load_dump(_dump(tmp_path, "a", [1.0, 2.0, 3.0, float("nan")]))
    b = load_dump(_dump(tmp_path, "b", [1.0, 2.0 + 1e-9, 3.5, float("nan")]))
    assert first_difference(a, a) is None
    d = first_difference(a, b)  # 2 + 1e-9 is within the tolerance; 3 vs 3.5 is the first difference
    assert (d.step, d.a["name"], d.stat, d.a["max"], d.b["max"]) == (1, "m2", "max", 3.0, 3.5)
    assert first_difference(a, b, atol=1.0) is None
    assert a[(1, 0)][3]["max"] is None and a[(1, 0)][3]["nan"] == 1  # a lone NaN: no finite value, one NaN
    nan = float("nan")
    assert close(nan, nan, 0.0, 0.0) and not close(nan, 1.0, 1.0, 1.0) and not close(None, 0.0, 1.0, 1.0)
    assert main(["compare-dumps", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "step 1, rank 0" in out and "m2" in out and "statistic max: A=3.0 B=3.5" in out
    assert main(["compare-dumps", str(tmp_path / "a"), str(tmp_path / "a")]) == 0


def test_mismatched_and_missing_dumps_are_refused(tmp_path, capsys):
    a = load_dump(_dump(tmp_path, "a", [1.0]))
    other = tmp_path / "c" / "step_2" / "rank_0"
    other.mkdir(parents=True)
    (other / "key_data.jsonl").write_text((tmp_path / "a/step_1/rank_0/actor_infer.jsonl").read_text())
    with pytest.raises(DumpError, match=r"different steps or ranks.*only in A \[\(1, 0\)\], only in B \[\(2, 0\)\]"):
        first_difference(a, load_dump(tmp_path / "c"))
    assert main(["compare-dumps", str(tmp_path / "a"), str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such dump folder" in capsys.readouterr().err
    (tmp_path / "bad/step_1/rank_0").mkdir(parents=True)
    (tmp_path / "bad/step_1/rank_0/key_data.jsonl").write_text('{"seq": 0}\n')
    with pytest.raises(DumpError, match=r"key_data.jsonl:1: not a dump record \(missing role, name"):
        load_dump(tmp_path / "bad")
