"""The preprocessing job: handler outputs on hand-written rows, formats, filters and bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from posttrain.data import preprocess as pp
from posttrain.data.datasets import find_fields
from posttrain.data.indexed import IndexedDataset
from posttrain.errors import ConfigError, DataError

MAP = {"prompt": "problem", "query": "", "response": "answer", "system": ""}


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _jsonl(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def _cfg(tmp_path, tok_dir, input_path, **kw):
    cfg = dict(input=str(input_path), handler_name="R1AlpacaStyleInstructionHandler", prompt_type="qwen_r1",
               tokenizer_name_or_path=tok_dir, output_prefix=str(tmp_path / "out" / "data"), map_keys=MAP,
               dataset_additional_keys=["labels"])
    cfg.update(kw)
    return cfg


def _read(prefix, key):
    ds = IndexedDataset(f"{prefix}_packed_{key}_document")
    return [ds[i].tolist() for i in range(len(ds))]


ROWS = [{"problem": "What is 2 + 3?", "answer": "5"}, {"problem": "What is 7 + 1?", "answer": 8}]


def test_r1_handler_outputs(tmp_path, tok_dir, tok):
    from posttrain.data.templates import get_template

    s = pp.preprocess(_cfg(tmp_path, tok_dir, _jsonl(tmp_path / "in.jsonl", ROWS)), progress=False)
    assert (s.rows_read, s.rows_written, s.rows_skipped) == (2, 2, 0)
    prefix = str(tmp_path / "out" / "data")
    assert sorted(find_fields(prefix)) == ["attention_mask", "input_ids", "labels"]
    ids, labels, mask = _read(prefix, "input_ids"), _read(prefix, "labels"), _read(prefix, "attention_mask")
    assert tok.decode(ids[0]) == get_template("qwen_r1").render_prompt("What is 2 + 3?")
    assert mask[0] == [1] * len(ids[0])
    assert labels == [tok.encode("5", add_special_tokens=False), tok.encode("8", add_special_tokens=False)]


def test_workers_2_writes_identical_files(tmp_path, tok_dir):
    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1500)]
    path = _jsonl(tmp_path / "in.jsonl", rows)
    pp.preprocess(_cfg(tmp_path, tok_dir, path, output_prefix=str(tmp_path / "a" / "d")), progress=False)
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path, output_prefix=str(tmp_path / "b" / "d"), workers=2), progress=False)
    assert s.rows_written == 1500
    for key in ("input_ids", "labels"):
        for ext in (".bin", ".idx"):
            a = (tmp_path / "a" / f"d_packed_{key}_document{ext}").read_bytes()
            assert a == (tmp_path / "b" / f"d_packed_{key}_document{ext}").read_bytes()


def test_math17k_alignment(tmp_path, tok_dir, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "Solve x+1=2."}],
                                   "reward_model": {"ground_truth": "1", "style": "rule"}}])
    pq.write_table(table, tmp_path / "m.parquet")
    s = pp.preprocess(_cfg(tmp_path, tok_dir, tmp_path / "m.parquet", handler_name="Math17kAlpacaStyleInstructionHandler",
                           prompt_type="empty", map_keys={"prompt": "prompt", "query": "", "response": "reward_model",
                                                          "system": ""}), progress=False)
    prefix = str(tmp_path / "out" / "data")
    assert s.rows_written == 1
    assert tok.decode(_read(prefix, "input_ids")[0]) == "Solve x+1=2."
    assert _read(prefix, "labels")[0] == tok.encode("1", add_special_tokens=False)


def test_sft_labels_mask_prompt(tmp_path, tok_dir, tok):
    path = _jsonl(tmp_path / "in.jsonl", ROWS[:1])
    pp.preprocess(_cfg(tmp_path, tok_dir, path, handler_name="AlpacaStyleInstructionHandler", prompt_type="qwen",
                       dataset_additional_keys=[]), progress=False)
    prefix = str(tmp_path / "out" / "data")
    ids, labels = _read(prefix, "input_ids")[0], _read(prefix, "labels")[0]
    answer = tok.encode("5", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert len(ids) == len(labels)
    n_prompt = len(ids) - len(answer)
    assert labels == [-100] * n_prompt + answer and ids[n_prompt:] == answer
    assert tok.decode(ids).endswith("<|im_start|>assistant\n5<|im_end|>")


def test_sft_pack(tmp_path, tok_dir):
    rows = [{"problem": "p" * (i % 7 + 1), "answer": "a" * (i % 5 + 1)} for i in range(40)]
    path = _jsonl(tmp_path / "in.jsonl", rows)
    cfg = _cfg(tmp_path, tok_dir, path, handler_name="AlpacaStyleInstructionHandler", prompt_type="empty",
               dataset_additional_keys=[], pack=True, seq_length=32, neat_pack=True)
    plain = _cfg(tmp_path, tok_dir, path, handler_name="AlpacaStyleInstructionHandler", prompt_type="empty",
                 dataset_additional_keys=[], output_prefix=str(tmp_path / "plain" / "d"))
    s = pp.preprocess(cfg, progress=False)
    pp.preprocess(plain, progress=False)
    prefix = str(tmp_path / "out" / "data")
    ids, labels, mask = _read(prefix, "input_ids"), _read(prefix, "labels"), _read(prefix, "attention_mask")
    assert s.packed_rows == len(ids) and all(len(r) == 32 for r in ids + labels + mask)
    # every sample appears once: the non-pad tokens equal the unpacked samples as a multiset
    unpacked = _read(str(tmp_path / "plain" / "d"), "input_ids")
    packed_samples = []
    for row, m in zip(ids, mask):
        m = np.array(m)
        for k in range(1, m.max() + 1):
            packed_samples.append(tuple(np.array(row)[m == k]))
        assert all(v == -100 for v, mm in zip(labels[ids.index(row)], m) if mm == 0)
    assert sorted(packed_samples) == sorted(tuple(u) for u in unpacked)
    assert all(sum(1 for x in m if x > 0) <= 31 for m in mask)  # capacity seq_length - 1


def test_pairwise(tmp_path, tok_dir, tok):
    rows = [{"question": "Q1", "chosen": "good", "rejected": "bad answer", "system": "be nice"}]
    path = _jsonl(tmp_path / "in.jsonl", rows)
    pp.preprocess(_cfg(tmp_path, tok_dir, path, handler_name="AlpacaStylePairwiseHandler", prompt_type="qwen3",
                       map_keys={"prompt": "question", "query": "", "system": "system"}, dataset_additional_keys=[],
                       enable_thinking=True, seq_length=4096), progress=False)
    prefix = str(tmp_path / "out" / "data")
    assert sorted(find_fields(prefix)) == ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
    c_ids, c_lab = _read(prefix, "chosen_input_ids")[0], _read(prefix, "chosen_labels")[0]
    r_ids, r_lab = _read(prefix, "rejected_input_ids")[0], _read(prefix, "rejected_labels")[0]
    prompt = "<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(c_ids) == prompt + "<think>\n\n</think>\n\ngood<|im_end|>\n"
    assert tok.decode(r_ids) == prompt + "<think>\n\n</think>\n\nbad answer<|im_end|>\n"
    n = len(tok.encode(prompt))
    assert c_lab[:n] == [-100] * n and c_lab[n:] == c_ids[n:] and r_lab[n:] == r_ids[n:]


def test_seq_length_filter_is_ge(tmp_path, tok_dir):
    rows = [{"problem": "short", "answer": "1"}, {"problem": "a much longer question " * 3, "answer": "2"}]
    path = _jsonl(tmp_path / "in.jsonl", rows)
    pp.preprocess(_cfg(tmp_path, tok_dir, path, prompt_type="empty"), progress=False)
    short, long = (len(x) for x in _read(str(tmp_path / "out" / "data"), "input_ids"))
    assert short < long
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path, prompt_type="empty", seq_length=long), progress=False)
    assert s.rows_written == 1 and s.skipped == {pp.SKIP_TOO_LONG: 1}  # length == seq_length is skipped
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path, prompt_type="empty", seq_length=long + 1), progress=False)
    assert s.rows_written == 2
    with pytest.raises(DataError, match="every row was skipped"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, prompt_type="empty", seq_length=short,
                           output_prefix=str(tmp_path / "x" / "d")), progress=False)
    assert not (tmp_path / "x" / "d_packed_input_ids_document.idx").exists()


def test_input_formats_and_directory(tmp_path, tok_dir):
    import pyarrow as pa
    import pyarrow.csv as pcsv

    d = tmp_path / "dir"
    d.mkdir()
    _jsonl(d / "a.jsonl", ROWS[:1])
    _jsonl(d / "b.jsonl", ROWS[1:])
    pcsv.write_csv(pa.Table.from_pylist([{"problem": "csv only", "answer": "1"}]), d / "c.csv")
    s = pp.preprocess(_cfg(tmp_path, tok_dir, d), progress=False)
    assert s.rows_read == 2  # jsonl is the most frequent extension; the csv is ignored
    s = pp.preprocess(_cfg(tmp_path, tok_dir, d / "c.csv"), progress=False)
    assert s.rows_written == 1
    (tmp_path / "arr.json").write_text(json.dumps(ROWS))  # a JSON array
    assert pp.preprocess(_cfg(tmp_path, tok_dir, tmp_path / "arr.json"), progress=False).rows_written == 2
    import pyarrow.ipc as ipc

    table = pa.Table.from_pylist(ROWS[:1] * 3)
    with ipc.new_stream(str(tmp_path / "d.arrow"), table.schema) as w:  # HF datasets' cache format
        w.write_table(table)
    assert pp.preprocess(_cfg(tmp_path, tok_dir, tmp_path / "d.arrow"), progress=False).rows_written == 3


# --- bad input --------------------------------------------------------------------------
def test_malformed_line_skipped_or_strict(tmp_path, tok_dir, capsys):
    path = _jsonl(tmp_path / "in.jsonl", ROWS, ["{not json", "[1, 2]"])
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    assert s.rows_written == 2 and s.skipped == {pp.SKIP_MALFORMED: 2} and s.rows_read == 4
    err = capsys.readouterr().err
    assert f"{path}:3: malformed JSON" in err and f"{path}:4: expected a JSON object" in err
    with pytest.raises(DataError, match=r"in\.jsonl:3: malformed JSON.*--strict"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, output_prefix=str(tmp_path / "s" / "d")), strict=True, progress=False)
    assert not (tmp_path / "s" / "d_packed_input_ids_document.bin").exists()


def test_missing_column_lists_columns(tmp_path, tok_dir):
    path = _jsonl(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(ConfigError, match=r"question.*does not exist.*columns: answer, problem"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, map_keys={"prompt": "question"}), progress=False)
    with pytest.raises(ConfigError, match="bogus is invalid, Please check map_keys"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, map_keys={"bogus": "problem"}), progress=False)


def test_empty_prompt_or_response_skipped(tmp_path, tok_dir):
    rows = ROWS + [{"problem": "  ", "answer": "1"}, {"problem": "q", "answer": ""}, {"problem": "q", "answer": None}]
    s = pp.preprocess(_cfg(tmp_path, tok_dir, _jsonl(tmp_path / "in.jsonl", rows)), progress=False)
    assert s.rows_written == 2 and s.skipped == {"empty prompt": 1, "empty response": 2}


def test_unknown_template_and_handler(tmp_path, tok_dir):
    path = _jsonl(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(ConfigError, match="Known: .*qwen_r1"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, prompt_type="qwen9"), progress=False)
    with pytest.raises(ConfigError, match="Unknown data handler 'FooHandler'; known: .*R1AlpacaStyleInstructionHandler"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, handler_name="FooHandler"), progress=False)
    with pytest.raises(ConfigError, match="enable_thinking only support"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, enable_thinking=True), progress=False)
    with pytest.raises(ConfigError, match="unknown key 'inptu'"):
        pp.preprocess(_cfg(tmp_path, tok_dir, path, inptu="x"), progress=False)


def test_missing_output_dir_is_created(tmp_path, tok_dir):
    out = tmp_path / "deep" / "er" / "data"
    pp.preprocess(_cfg(tmp_path, tok_dir, _jsonl(tmp_path / "in.jsonl", ROWS), output_prefix=str(out)), progress=False)
    assert (tmp_path / "deep" / "er" / "data_packed_input_ids_document.idx").is_file()


def test_interrupted_run_leaves_no_dataset(tmp_path, tok_dir, monkeypatch):
    rows = [{"problem": f"q{i}", "answer": "1"} for i in range(3 * pp.BATCH_ROWS)]
    path = _jsonl(tmp_path / "in.jsonl", rows)
    real, calls = pp.process_batch, []

    def dies_on_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(pp, "process_batch", dies_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    assert os.listdir(tmp_path / "out") == []  # no final files, no temporaries


def test_cli_with_overrides(tmp_path, tok_dir, capsys):
    from posttrain.cli import main

    path = _jsonl(tmp_path / "in.jsonl", ROWS)
    rc = main(["preprocess", "--config-name", "demo_chain_sum", f"input={path}", f"tokenizer_name_or_path={tok_dir}",
               f"output_prefix={tmp_path / 'cli' / 'data'}"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "rows read: 2, rows written: 2" in out
    assert sorted(find_fields(tmp_path / "cli" / "data")) == ["attention_mask", "input_ids", "labels"]
    assert main(["preprocess", "--config-name", "demo_chain_sum", "input=/nonexistent.jsonl",
                 f"tokenizer_name_or_path={tok_dir}", f"output_prefix={tmp_path / 'x'}"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["deepscaler", "math_17k", "orca_rlhf", "demo_chain_sum", "demo_chain_sum_sft"])
def test_shipped_dataset_configs_validate(name):
    from posttrain.commands.preprocess import load_config

    cfg = load_config(name, overrides=["tokenizer_name_or_path=some/dir", "workers=2"])
    assert cfg.workers == 2 and cfg.tokenizer_name_or_path == "some/dir" and cfg.map_keys["prompt"]


def test_sft_append_eod_and_hf_chat_template(tmp_path, tok_dir, tok):
    path = _jsonl(tmp_path / "in.jsonl", ROWS[:1])
    pp.preprocess(_cfg(tmp_path, tok_dir, path, handler_name="AlpacaStyleInstructionHandler", prompt_type="empty",
                       dataset_additional_keys=[], append_eod=True), progress=False)
    ids, labels = _read(str(tmp_path / "out" / "data"), "input_ids")[0], _read(str(tmp_path / "out" / "data"), "labels")[0]
    assert ids[-1] == labels[-1] == tok.eos_token_id and tok.decode(ids) == "What is 2 + 3?5<|im_end|>"
    pp.preprocess(_cfg(tmp_path, tok_dir, path, prompt_type="hf_chat_template",
                       output_prefix=str(tmp_path / "hf" / "d")), progress=False)
    prompt = _read(str(tmp_path / "hf" / "d"), "input_ids")[0]
    assert tok.decode(prompt) == tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                         tokenize=False, add_generation_prompt=True)


def test_r1_history_keeps_user_turns_only(tmp_path, tok_dir, tok):
    rows = [{"instruction": "Q2", "output": "A2", "hist": [["Q1", "A1"]], "sys": "S"}]
    pp.preprocess(_cfg(tmp_path, tok_dir, _jsonl(tmp_path / "in.jsonl", rows), prompt_type="qwen",
                       map_keys={"history": "hist", "system": "sys"}), progress=False)
    text = tok.decode(_read(str(tmp_path / "out" / "data"), "input_ids")[0])
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
                    "\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n")  # the seed drops A1<|im_end|>


# ---- hostile rows (the reliability probe, docs/reliability.md) ---------------------------------------
def _jsonl_bytes(path, lines: list[bytes]) -> str:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def _nothing_in(folder) -> bool:
    return not folder.exists() or not list(folder.iterdir())


def _row(problem, answer) -> bytes:
    return json.dumps({"problem": problem, "answer": answer}).encode()


def test_invalid_utf8_rows_are_counted(tmp_path, tok_dir, capsys):
    """Probe D6: rows with non-UTF-8 bytes."""
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


def test_structured_prompt_is_skipped_with_a_reason(tmp_path, tok_dir, capsys):
    """Probe D9: a prompt that is a dict or a list, an int answer, a dict response."""
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


def test_bom_file_keeps_its_first_row(tmp_path, tok_dir):
    """Probe D11: a JSONL and a JSON file that start with a UTF-8 BOM."""
    rows = [_row("What is 1 + 1?", "2"), _row("What is 2 + 2?", "4")]
    path = _jsonl_bytes(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + rows[0], rows[1]])
    s = pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False, strict=True)
    assert (s.rows_written, s.rows_skipped) == (2, 0)
    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf[" + b",".join(rows) + b"]")
    s = pp.preprocess(_cfg(tmp_path, tok_dir, array, output_prefix=str(tmp_path / "a" / "d")), progress=False)
    assert (s.rows_written, s.rows_skipped) == (2, 0)


def test_strict_stops_at_a_skipped_row(tmp_path, tok_dir, capsys):
    """Probe D15: ``--strict`` on rows without a prompt."""
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


def test_stale_temporaries_of_the_prefix_are_removed(tmp_path, tok_dir, capsys):
    """Probe D19: temporaries of the prefix left by a killed run."""
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
