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
