"""The Python API as the README and examples/python_api.py use it: the README's block runs as
written (from a fresh directory) and trains; the example's reward climbs; a dataset given as a
Hugging Face ``datasets.Dataset`` or a Parquet file is preprocessed as a list of dicts is; the API's
errors name what to do."""

from __future__ import annotations

import re
import runpy
import sys

import pytest

import posttrain
from posttrain.errors import ConfigError
from posttrain.paths import PROJECT_ROOT

pytestmark = pytest.mark.slow


def readme_block() -> str:
    text = (PROJECT_ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):text.index("## Configs")]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_block_runs_as_written(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(readme_block(), "README.md (Python API)", "exec"), scope)
    summary = scope["summary"]
    assert [row["iteration"] for row in summary.history if "actor/pg_loss" in row] == [1, 2]
    assert summary.history[-1]["iteration"] == 2 and "grpo/score/mean" in summary.metrics
    assert (tmp_path / "runs/api/ckpt/iter_0000002").is_dir() and summary.save_dir.name == "ckpt"
    assert scope["plan"].n == 4  # the plan took its override
    assert list((tmp_path / "runs/api/grpo/data").glob("train*.bin"))  # the rows, preprocessed on the fly


def test_the_example_trains_its_python_reward_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["python_api.py", str(tmp_path / "out")])
    runpy.run_path(str(PROJECT_ROOT / "examples/python_api.py"), run_name="__main__")
    scores = [float(x) for x in re.search(r"reward per iteration: (.*)", capsys.readouterr().out).group(1).split(", ")]
    assert len(scores) == 10 and scores[-1] > 2 * scores[0] + 0.05, scores  # measured 0.05 -> 0.37


@pytest.mark.parametrize("kind", ["dataset", "parquet"])
def test_a_datasets_dataset_or_a_parquet_file_is_preprocessed_like_rows(tmp_path, kind):
    from posttrain.api import prepare_data

    rows = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in (1, 2)]
    model = posttrain.init_model("tiny_qwen2", tmp_path / "model", seed=1)
    if kind == "dataset":
        import datasets

        data = datasets.Dataset.from_list(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data)
    want = prepare_data(rows, "tiny_add", str(model), tmp_path / "from_rows")
    assert prepare_data(data, "tiny_add", str(model), tmp_path / f"from_{kind}").endswith("train")
    for suffix in ("_packed_input_ids_document.bin", "_packed_labels_document.bin"):
        assert (tmp_path / f"from_{kind}" / f"train{suffix}").read_bytes() == (tmp_path / "from_rows" /
                                                                                f"train{suffix}").read_bytes()
    assert want.endswith("train")


def test_api_errors_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="name its section"):
        posttrain.plan("grpo_tiny_qwen2", n_samples_per_prompt=4)
    with pytest.raises(ConfigError, match="dataset_config"):
        posttrain.train("grpo_tiny_qwen2", data=[{"problem": "1+1", "answer": "2"}])
    with pytest.raises(ConfigError, match="list of dicts"):
        posttrain.api.prepare_data(42, "tiny_add", "model", tmp_path)
