"""The tool-use demo's warm start lands in its accuracy band on any machine
(:func:`posttrain.demo.tool_use.capped_warm_start`): a jump between two saved SFT steps is bridged
by a blend of the two checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.demo.tool_use import blend, capped_warm_start


def _checkpoint(root: Path, step: int, value: float) -> tuple[int, Path]:
    path = root / f"iter_{step:07d}"
    path.mkdir(parents=True)
    save_file({"w": torch.full((3,), value)}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text("{}")
    (path / "trainer_state.json").write_text("{}")
    return step, path


def _accuracy(path: Path) -> float:
    """A model whose validation accuracy is its weight: 0.1 before the jump, 0.7 after it."""
    return round(float(load_file(str(path / "model.safetensors"))["w"][0]), 4)


def test_a_jump_past_the_band_is_bridged_by_a_blend(tmp_path):
    checkpoints = [_checkpoint(tmp_path, s, v) for s, v in ((5, 0.0), (10, 0.1), (15, 0.7), (20, 0.9))]
    step, path, accuracy = capped_warm_start(checkpoints, _accuracy, 0.4, 0.1, tmp_path / "blend")
    assert 0.4 <= accuracy <= 0.5 and accuracy == _accuracy(path)
    assert 10 < step < 15 and path.parent == tmp_path / "blend"
    assert not (path / "trainer_state.json").exists()  # a plain model directory, loaded as weights


def test_a_checkpoint_in_the_band_is_taken_as_it_is(tmp_path):
    checkpoints = [_checkpoint(tmp_path, s, v) for s, v in ((5, 0.1), (10, 0.45), (15, 0.9))]
    assert capped_warm_start(checkpoints, _accuracy, 0.4, 0.1, tmp_path / "blend") == (10.0, checkpoints[1][1], 0.45)
    assert not (tmp_path / "blend").exists()


def test_none_reaching_the_target_gives_the_last(tmp_path):
    checkpoints = [_checkpoint(tmp_path, s, v) for s, v in ((5, 0.1), (10, 0.2))]
    assert capped_warm_start(checkpoints, _accuracy, 0.4, 0.1, tmp_path / "blend")[:2] == (10.0, checkpoints[1][1])


def test_blend_is_the_linear_interpolation(tmp_path):
    (_, low), (_, high) = _checkpoint(tmp_path, 1, 2.0), _checkpoint(tmp_path, 2, 4.0)
    out = blend(low, high, 0.25, tmp_path / "mix")
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.full((3,), 2.5))
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("a", [0.0, 1.0])
def test_blend_ends_are_the_checkpoints(tmp_path, a):
    (_, low), (_, high) = _checkpoint(tmp_path, 1, 2.0), _checkpoint(tmp_path, 2, 4.0)
    out = blend(low, high, a, tmp_path / "mix")
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.full((3,), 4.0 if a else 2.0))
