"""Hostile data (issue 14, reliability probe section 1.2): each test is named after its probe case."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from posttrain.data import preprocess as pp
from posttrain.data.datasets import PromptDataset, SFTDataset
from posttrain.data.indexed import IndexedDataset, IndexedDatasetBuilder
from posttrain.errors import DataError

MAP = {"prompt": "problem", "query": "", "response": "answer", "system": ""}
ROWS = 1000  # 4 tokens each: the input_ids .bin has 16000 bytes, as in the probe
HEADER = 34  # magic 9 + version 8 + dtype 1 + count 8 + document count 8


def _cfg(tmp_path, tok_dir, input_path, **kw):
    cfg = dict(input=str(input_path), handler_name="R1AlpacaStyleInstructionHandler", prompt_type="qwen_r1",
               tokenizer_name_or_path=tok_dir, output_prefix=str(tmp_path / "out" / "data"), map_keys=MAP,
               dataset_additional_keys=["labels"])
    cfg.update(kw)
    return cfg


def _jsonl_bytes(path, lines: list[bytes]) -> str:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def _nothing_in(folder) -> bool:
    return not folder.exists() or not list(folder.iterdir())


def _row(problem, answer) -> bytes:
    return json.dumps({"problem": problem, "answer": answer}).encode()


# --- D24-D27: a corrupt .idx is detected when the dataset is opened ---------------------
def _prompt_dataset(tmp_path) -> str:
    """A prompt dataset written with the project's writer: 1000 prompts of 4 tokens, answers of 1-3."""
    prefix = str(tmp_path / "data")
    rng = np.random.default_rng(0)
    lengths = {"input_ids": np.full(ROWS, 4), "attention_mask": np.full(ROWS, 4),
               "labels": rng.integers(1, 4, ROWS)}
    for key, lens in lengths.items():
        b = IndexedDatasetBuilder(f"{prefix}_packed_{key}_document.bin")
        b.add_items(rng.integers(1, 300, int(lens.sum())), lens)
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    return prefix


def _reads(ds: PromptDataset) -> list[list[list[int]]]:
    return [[v.tolist() for v in ds[i].values()] for i in range(len(ds))]


def _pointer_500_far_out(raw: bytearray, rng) -> None:
    o = HEADER + 4 * ROWS + 8 * 500
    raw[o:o + 8] = struct.pack("<q", 10**12)


def _length_10_is_2_30(raw: bytearray, rng) -> None:
    o = HEADER + 4 * 10
    raw[o:o + 4] = struct.pack("<i", 2**30)


def _pointers_0_to_n_2_past_the_end(raw: bytearray, rng) -> None:
    o = HEADER + 4 * ROWS
    raw[o:o + 8 * (ROWS - 1)] = np.full(ROWS - 1, 16000, np.int64).tobytes()


def _pointers_0_to_n_2_shuffled(raw: bytearray, rng) -> None:
    o = HEADER + 4 * ROWS
    ptrs = np.frombuffer(bytes(raw[o:o + 8 * (ROWS - 1)]), np.int64).copy()
    rng.shuffle(ptrs)
    raw[o:o + 8 * (ROWS - 1)] = ptrs.tobytes()


CORRUPTIONS = {
    "pointer_far_out": (_pointer_500_far_out,
                        r"input_ids_document\.idx: row 500 points at byte 1000000000000 but the \.bin has 16000 bytes"
                        r"; re-run posttrain preprocess"),
    "length_2_30": (_length_10_is_2_30, r"input_ids_document\.idx: row 10 is 1073741824 tokens long"),
    "pointers_0_to_n_2_past_the_end": (_pointers_0_to_n_2_past_the_end,
                                       r"input_ids_document\.idx: row 0 is 4 tokens long \(16 bytes from byte 16000\)"),
    "pointers_0_to_n_2_shuffled": (_pointers_0_to_n_2_shuffled, r"input_ids_document\.idx: row \d+ points at byte \d+"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS) + [f"byte_flips_seed{s}_{n}" for s in range(12) for n in (1, 50)])
def test_D24_D27_corrupt_index_names_file_and_row(tmp_path, case):
    prefix = _prompt_dataset(tmp_path)
    before = _reads(PromptDataset(prefix))
    idx = f"{prefix}_packed_input_ids_document.idx"
    raw = bytearray(open(idx, "rb").read())
    if case in CORRUPTIONS:
        corrupt, message = CORRUPTIONS[case]
        corrupt(raw, np.random.default_rng(1))
        open(idx, "wb").write(bytes(raw))
        with pytest.raises(DataError, match=message):
            PromptDataset(prefix)
        with pytest.raises(DataError, match=message):  # the reader itself, not only the dataset
            IndexedDataset(idx[: -len(".idx")])
        return
    seed, flips = (int(x) for x in case[len("byte_flips_seed"):].split("_"))
    rng = np.random.default_rng(seed)
    for pos in rng.choice(len(raw), size=flips, replace=False):
        raw[pos] = (raw[pos] + int(rng.integers(1, 256))) % 256  # always a different byte
    open(idx, "wb").write(bytes(raw))
    try:
        after = _reads(PromptDataset(prefix))
    except DataError as err:
        assert "input_ids_document.idx" in str(err) or "input_ids_document.bin" in str(err), err
        return
    assert after == before, "a corrupt index was read as different data without an error"


def test_D24_D27_empty_prompt_names_file_and_row(tmp_path):
    """A prompt dataset whose row 7 has no tokens (a consistent index) is refused when opened."""
    prefix = str(tmp_path / "data")
    for key, lens in (("input_ids", [3] * 7 + [0] + [3] * 2), ("labels", [1] * 10)):
        b = IndexedDatasetBuilder(f"{prefix}_packed_{key}_document.bin")
        b.add_items(np.ones(sum(lens)), np.array(lens))
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    with pytest.raises(DataError, match=r"input_ids_document\.idx: row 7 is an empty prompt"):
        PromptDataset(prefix)


# --- D6, D9, D11, D15, D19: preprocessing hostile rows -----------------------------------
def test_D6_invalid_utf8_rows_are_counted(tmp_path, tok_dir, capsys):
    path = _jsonl_bytes(tmp_path / "in.jsonl", [_row("What is 1 + 1?", "2"),
                                                b'{"problem": "caf\xe9 \xff\xfe is what?", "answer": "3"}',
                                                _row("What is 2 + 2?", "4"),
                                                b'{"problem": "\xff again", "answer": "5"}'])
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    assert s.rows_written == 4 and s.invalid_utf8 == 2
    assert "rows with invalid UTF-8 (replaced): 2" in s.format()
    err = capsys.readouterr().err
    assert f"{path}:2: invalid UTF-8" in err and f"{path}:4" not in err  # one warning per file
    with pytest.raises(DataError, match=r"in\.jsonl:2: invalid UTF-8 bytes \(stopping because of --strict\)"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, output_prefix=str(tmp_path / "s" / "d")), strict=True,
                      progress=False)
    assert _nothing_in(tmp_path / "s")


def test_D9_structured_prompt_is_skipped_with_reason(tmp_path, tok_dir, capsys):
    from transformers import AutoTokenizer

    path = _jsonl_bytes(tmp_path / "in.jsonl", [_row({"a": 1}, "1"), _row([1, 2], "2"), _row("What is 7 + 1?", 8),
                                                _row("What is 1 + 1?", {"x": 2})])
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    assert s.rows_written == 1
    assert s.skipped == {"prompt is a dict, expected text": 1, "prompt is a list, expected text": 1,
                         "response is a dict, expected text": 1}
    assert "skipped (prompt is a dict, expected text): 1" in s.format()
    assert f"skip {path}:1: prompt is a dict, expected text" in capsys.readouterr().err
    labels = IndexedDataset(tmp_path / "out" / "data_packed_labels_document")
    assert labels[0].tolist() == AutoTokenizer.from_pretrained(tok_dir).encode("8", add_special_tokens=False)


def test_D11_bom_file_keeps_its_first_row(tmp_path, tok_dir):
    rows = [_row("What is 1 + 1?", "2"), _row("What is 2 + 2?", "4")]
    path = _jsonl_bytes(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + rows[0], rows[1]])
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False, strict=True)
    assert (s.rows_written, s.rows_skipped) == (2, 0)
    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf[" + b",".join(rows) + b"]")
    s = pp.preprocess(_cfg(tmp_path, tok_dir, array, output_prefix=str(tmp_path / "a" / "d")), progress=False)
    assert (s.rows_written, s.rows_skipped) == (2, 0)


def test_D15_strict_stops_at_a_skipped_row(tmp_path, tok_dir, capsys):
    from posttrain.cli import main

    path = _jsonl_bytes(tmp_path / "in.jsonl", [_row("What is 1 + 1?", "2"), b'{"answer": "3"}', b'{"answer": "4"}'])
    with pytest.raises(DataError, match=r"in\.jsonl:2: empty prompt \(stopping because of --strict\)"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path), strict=True, progress=False)
    assert _nothing_in(tmp_path / "out")
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "strict.yaml").write_text(json.dumps(_cfg(tmp_path, tok_dir, path)))  # JSON is YAML
    capsys.readouterr()
    assert main(["preprocess", "--config-name", "strict", "--config-path", str(conf), "--strict"]) == 2
    assert f"{path}:2: empty prompt (stopping because of --strict)" in capsys.readouterr().err


def test_D19_stale_temporaries_of_the_prefix_are_removed(tmp_path, tok_dir, capsys):
    out = tmp_path / "out"
    out.mkdir()
    dead = 2**22 + 12345  # above the default pid_max: no such process
    stale = [out / f".data_packed_input_ids_document.tmp{dead}.bin", out / f".data_packed_labels_document.tmp{dead}.idx"]
    alive = out / f".data_packed_input_ids_document.tmp{os.getppid()}.bin"  # a running process: kept
    other = out / f".other_packed_input_ids_document.tmp{dead}.bin"  # another prefix: kept
    for p in [*stale, alive, other]:
        p.write_bytes(b"x")
    path = _jsonl_bytes(tmp_path / "in.jsonl", [_row("What is 1 + 1?", "2")])
    pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    assert not any(p.exists() for p in stale) and alive.exists() and other.exists()
    assert "removed 2 temporary file(s) left by an interrupted run" in capsys.readouterr().err


def test_preprocess_writes_only_output_files(tmp_path, tok_dir):
    path = _jsonl_bytes(tmp_path / "in.jsonl", [_row("What is 1 + 1?", "2")])
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    expected = pp.output_files(str(tmp_path / "out" / "data"), ["input_ids", "attention_mask", "labels"])
    assert sorted(str(p) for p in (tmp_path / "out").iterdir()) == sorted(expected)
    assert sorted(f"{p}{e}" for p in s.outputs.values() for e in (".bin", ".idx")) == sorted(expected)


# --- D29: the sft stage on an RL prompt dataset -------------------------------------------
def test_D29_sft_on_a_prompt_dataset_is_a_clear_error(tmp_path, tok_dir):
    path = _jsonl_bytes(tmp_path / "in.jsonl", [_row("What is 1 + 1?", "2"), _row("What is 2 + 2?", "4")])
    pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    prefix = str(tmp_path / "out" / "data")
    with pytest.raises(DataError, match=rf"data_path {prefix} is not an SFT dataset: row 0 has \d+ input_ids tokens "
                                        r"but 1 labels.*handler_name=AlpacaStyleInstructionHandler"):
        SFTDataset(prefix, seq_length=32)
