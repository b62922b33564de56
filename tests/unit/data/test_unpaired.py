"""UnpairedPreferenceHandler (KTO data): JSONL and Parquet round trips, and the refused rows."""

from __future__ import annotations

import pytest

from posttrain.data import preprocess as pp
from posttrain.data.datasets import UnpairedPreferenceDataset, find_fields
from posttrain.errors import ConfigError, DataError
from tests.unit.data.test_preprocess import _jsonl

ROWS = [{"prompt": "Q1", "completion": "good", "label": True},
        {"prompt": "Q2", "completion": "bad answer", "label": False},
        {"prompt": "Q3", "completion": "fine", "label": True}]
PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
          "<|im_start|>assistant\n")


def _cfg(tmp_path, tok_dir, path, **kw):
    return {"input": str(path), "handler_name": "UnpairedPreferenceHandler", "prompt_type": "qwen",
            "tokenizer_name_or_path": tok_dir, "output_prefix": str(tmp_path / "out" / "data"), **kw}


def _check_rows(prefix, tok, rows):
    assert sorted(find_fields(prefix)) == ["desirable", "input_ids", "labels"]
    ds = UnpairedPreferenceDataset(prefix)
    assert len(ds) == len(rows) and ds.label_counts() == (2, 1)
    for i, row in enumerate(rows):
        item = ds[i]
        prompt = PROMPT.format(row["prompt"])
        assert tok.decode(item["input_ids"]) == prompt + row["completion"] + "<|im_end|>"
        n = len(tok.encode(prompt))
        assert item["labels"][:n].tolist() == [-100] * n
        assert item["labels"][n:].tolist() == item["input_ids"][n:].tolist()
        assert item["desirable"].tolist() == [int(row["label"])]


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def test_jsonl_and_parquet_round_trip(tmp_path, tok_dir, tok):
    """TRL's column names (prompt, completion, label) by default; map_keys renames them."""
    pp.preprocess(_cfg(tmp_path, tok_dir, _jsonl(tmp_path / "in.jsonl", ROWS)), progress=False)
    _check_rows(str(tmp_path / "out" / "data"), tok, ROWS)

    import pyarrow as pa
    import pyarrow.parquet as pq

    renamed = [{"question": r["prompt"], "answer": r["completion"], "ok": r["label"]} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "in.parquet")
    pp.preprocess(_cfg(tmp_path, tok_dir, tmp_path / "in.parquet", output_prefix=str(tmp_path / "pq" / "data"),
                       map_keys={"prompt": "question", "response": "answer", "label": "ok"}), progress=False)
    _check_rows(str(tmp_path / "pq" / "data"), tok, ROWS)


@pytest.mark.parametrize("bad,message", [
    ({"prompt": "Q", "completion": "c"}, r"in\.jsonl:2: no label: an unpaired preference row needs a JSON/Parquet "
                                         r"bool label, true \(desirable\) or false \(undesirable\), in column 'label'"),
    ({"prompt": "Q", "completion": "c", "label": 1}, r"in\.jsonl:2: label 1 \(int\): an unpaired preference row"),
    ({"prompt": "Q", "completion": "c", "label": "yes"}, r"in\.jsonl:2: label 'yes' \(str\)"),
])
def test_bad_labels_name_the_row(tmp_path, tok_dir, bad, message):
    path = _jsonl(tmp_path / "in.jsonl", [ROWS[0], bad])
    with pytest.raises(DataError, match=message):
        pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    assert not find_fields_exist(tmp_path / "out")  # nothing half-written


def find_fields_exist(directory) -> bool:
    return any(directory.glob("*.idx")) if directory.exists() else False


def test_pack_is_refused(tmp_path, tok_dir):
    path = _jsonl(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(ConfigError, match="pack: true with handler_name: UnpairedPreferenceHandler"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, pack=True, seq_length=64), progress=False)


def test_dataset_refuses_labels_that_are_not_one_bit(tmp_path):
    from posttrain.data.preprocess import write_token_rows

    prefix = tmp_path / "d"
    write_token_rows(prefix, {"input_ids": [[5, 6, 7]], "labels": [[-100, 6, 7]], "desirable": [[2]]})
    with pytest.raises(DataError, match=r"row 0 of desirable .* is not one 0/1 label"):
        UnpairedPreferenceDataset(prefix)
