"""The demo's run (demo/run.py): a rerun clears only the checkpoints the demo wrote."""

from __future__ import annotations

from tests.helpers.runs import tree


def test_demo_rerun_clears_only_its_own_checkpoints(tmp_path):
    from posttrain.demo.run import clear_own_checkpoints

    save = tmp_path / "ckpt"
    (save / "iter_0000001").mkdir(parents=True)
    (save / ".iter_0000002.tmp-1-ab").mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("1\n")
    (save / "NOTES.txt").write_text("mine")
    clear_own_checkpoints(save)
    assert tree(save) == ["NOTES.txt"]
