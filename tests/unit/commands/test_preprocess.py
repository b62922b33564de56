"""``posttrain preprocess`` (commands/preprocess.py): an existing dataset is not replaced without
``--force``, and is checked before the work."""

from __future__ import annotations

from tests.helpers.runs import forbid, run_cli


def test_refuses_an_existing_dataset_unless_force(mini_world, tmp_path, capsys, monkeypatch):
    """Issue 14, item 1 (item1): an ``output_prefix`` whose dataset files exist."""
    prefix = tmp_path / "data" / "rl"
    argv = ["preprocess", "--config-name", "demo_chain_sum", f"input={mini_world / 'rl.jsonl'}",
            f"tokenizer_name_or_path={mini_world / 'model'}", f"output_prefix={prefix}",
            "map_keys.prompt=problem", "map_keys.response=answer"]
    prefix.parent.mkdir()
    (prefix.parent / "rl_packed_input_ids_document.bin").write_bytes(b"mine")
    real_preprocess = __import__("posttrain.data.preprocess", fromlist=["x"]).preprocess
    forbid(monkeypatch, "posttrain.commands.preprocess:preprocess")  # the name the command calls
    code, err = run_cli(argv, capsys)
    assert code == 2 and "rl_packed_input_ids_document.bin" in err and "--force" in err
    assert (prefix.parent / "rl_packed_input_ids_document.bin").read_bytes() == b"mine"
    monkeypatch.setattr("posttrain.commands.preprocess.preprocess", real_preprocess)
    assert run_cli([*argv, "--force"], capsys)[0] == 0
    assert (prefix.parent / "rl_packed_input_ids_document.bin").stat().st_size > 4


# ---- probe 3 (docs/reliability/probe3_cmds.md) -------------------------------------------------------------
def _argv(mini_world, prefix, *more):
    return ["preprocess", "--config-name", "demo_chain_sum", f"input={mini_world / 'rl.jsonl'}",
            f"tokenizer_name_or_path={mini_world / 'model'}", f"output_prefix={prefix}",
            "map_keys.prompt=problem", "map_keys.response=answer", *more]


def test_a_full_disk_mid_write_is_one_message_and_leaves_nothing(mini_world, tmp_path, capsys, monkeypatch):
    """Probes I4, CM33: the disk fills while the dataset is written: one message naming the
    output_prefix, no temporary file left, and the folder the run created is gone."""
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("posttrain.data.indexed.IndexedDatasetBuilder.add_items", full)
    prefix = tmp_path / "new" / "data"
    code, err = run_cli(_argv(mini_world, prefix), capsys)
    assert code == 2 and f"output_prefix {prefix}: writing the dataset failed" in err and "disk is full" in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_found_before_the_work(mini_world, tmp_path, capsys, monkeypatch):
    """Probe I4: a disk with no block free is refused before reading the input."""
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("posttrain.commands.outputs.os.write", full)
    forbid(monkeypatch, "posttrain.commands.preprocess:preprocess")
    code, err = run_cli(_argv(mini_world, tmp_path / "new" / "data"), capsys)
    assert code == 2 and "cannot write in" in err and "the disk is full" in err
    assert list(tmp_path.iterdir()) == []


def test_a_second_preprocess_into_the_same_folder_is_refused(mini_world, tmp_path, capsys, monkeypatch):
    """Probe Q4: while a preprocess holds the output folder, another one into it is refused with the
    holder named, before any work."""
    from posttrain.rundir import DirLock

    (tmp_path / "d").mkdir()
    holder = DirLock(tmp_path / "d", "test")
    try:
        forbid(monkeypatch, "posttrain.commands.preprocess:preprocess")
        code, err = run_cli(_argv(mini_world, tmp_path / "d" / "data"), capsys)
    finally:
        holder.release()
    assert code == 2 and f"output_prefix {tmp_path / 'd' / 'data'}: its folder" in err and "in use by another run" in err


def test_seq_length_beyond_a_row_and_duplicate_keys(mini_world, tmp_path, capsys):
    """Probes CM28 (seq_length 10^12 with pack: a MemoryError before) and CM31 (a row with a key
    written twice is skipped, named and counted)."""
    code, err = run_cli(_argv(mini_world, tmp_path / "a" / "data", "seq_length=1000000000000", "pack=true"), capsys)
    assert code == 2 and "seq_length=1000000000000: larger than a row of the indexed dataset can be" in err
    assert not (tmp_path / "a").exists()
    rows = (mini_world / "rl.jsonl").read_text().splitlines()[:3]
    src = tmp_path / "dup.jsonl"
    src.write_text("\n".join([rows[0][:-1] + ', "problem": "x"}', *rows[1:]]) + "\n")
    argv = _argv(mini_world, tmp_path / "b" / "data")
    argv[3] = f"input={src}"
    code, err = run_cli(argv, capsys)
    assert code == 0 and f"skip {src}:1: duplicate key 'problem'" in err


def test_a_row_too_long_for_seq_length_is_skipped_without_tokenizing_it(mini_world, tmp_path, capsys, monkeypatch):
    """Probe CM32: a 100 MB row (the tokenizer aborted at 6 GB after 70 s) is longer than seq_length
    tokens can hold: skipped as too long, named, before it is tokenized."""
    import json

    from posttrain.data.handlers import HANDLERS

    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"problem": "1+" * 200_000, "answer": "1"}) + "\n"
                   + (mini_world / "rl.jsonl").read_text().splitlines()[0] + "\n")
    cls = HANDLERS.get("R1AlpacaStyleInstructionHandler")
    real = cls.encode_batch

    def encode(self, items):
        assert all(len(m["content"]) < 10_000 for it in items for m in it.prompt), "a row too long was tokenized"
        return real(self, items)

    monkeypatch.setattr(cls, "encode_batch", encode)
    argv = _argv(mini_world, tmp_path / "d" / "data", "seq_length=512")
    argv[3] = f"input={src}"
    code, err = run_cli(argv, capsys)
    assert code == 0 and f"skip {src}:1: exceeds seq_length" in err, err
