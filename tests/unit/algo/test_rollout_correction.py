"""Rollout correction (TIS / MIS / IcePop) on hand-computed values: the groundwork of issue 20 (not yet a
config key)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algo.rollout_correction import rollout_correction
from posttrain.errors import ConfigError

OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, -1.0, -1.0]])
ROLLOUT = torch.tensor([[-1.0, -3.0, -0.4, 0.0], [-0.5, -0.5, -0.5, -0.5]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_none_measures_the_mismatch_only():
    weights, keep, m = rollout_correction(OLD, ROLLOUT, MASK)
    assert torch.equal(weights, MASK.float()) and torch.equal(keep, MASK.float())
    # |old - rollout| over the 5 response tokens: 0, 1, 0.1, 0.5, 0.5
    assert m["rollout/logprob_diff_mean"] == pytest.approx(2.1 / 5)
    assert m["rollout/logprob_diff_max"] == pytest.approx(1.0)
    ratios = [1.0, math.e, math.exp(-0.1), math.exp(-0.5), math.exp(-0.5)]
    assert m["rollout/ratio_mean"] == pytest.approx(sum(ratios) / 5)
    assert m["rollout/ratio_max"] == pytest.approx(math.e)
    assert m["rollout/masked_fraction"] == 0.0


def test_tis_truncates_the_weights_at_the_cap():
    weights, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="tis", cap=2.0)
    expected = torch.tensor([[1.0, 2.0, math.exp(-0.1), 0.0], [math.exp(-0.5), math.exp(-0.5), 0.0, 0.0]])
    assert torch.allclose(weights, expected) and torch.equal(keep, MASK.float())


def test_mis_masks_tokens_or_whole_sequences_outside_the_band():
    weights, keep, m = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", cap=2.0)
    assert torch.equal(weights, MASK.float())
    assert keep.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]  # e > 2; e^-0.5 = 0.61 >= 1/2
    assert m["rollout/masked_fraction"] == pytest.approx(1 / 5)
    _, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", cap=1.5, level="sequence")
    # geometric means: row 0 exp((0 + 1 - 0.1) / 3) = 1.35 (inside [0.67, 1.5]); row 1 exp(-0.5) = 0.61 (outside)
    assert keep.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]


def test_icepop_weights_inside_the_band_and_masks_outside():
    weights, keep, m = rollout_correction(OLD, ROLLOUT, MASK, mode="icepop", cap=2.0)  # band [0.5, 2]
    expected = torch.tensor([[1.0, 0.0, math.exp(-0.1), 0.0], [math.exp(-0.5), math.exp(-0.5), 0.0, 0.0]])
    assert torch.allclose(weights, expected) and keep.tolist() == [[1, 0, 1, 0], [1, 1, 0, 0]]
    assert m["rollout/masked_fraction"] == pytest.approx(1 / 5)
    weights, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="icepop", cap=5.0, floor=0.7)  # e in, 0.61 out
    assert torch.allclose(weights, torch.tensor([[1.0, math.e, math.exp(-0.1), 0.0], [0.0, 0.0, 0.0, 0.0]]))
    _, keep, _ = rollout_correction(OLD, ROLLOUT, MASK, mode="mis", cap=5.0, floor=0.7)  # mis takes the floor too
    assert keep.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]


def test_equal_logprobs_give_unit_weights_and_no_mismatch():
    weights, keep, m = rollout_correction(OLD, OLD, MASK, mode="mis")
    assert torch.equal(keep, MASK.float()) and m["rollout/logprob_diff_max"] == 0.0 and m["rollout/ratio_max"] == 1.0


@pytest.mark.parametrize("kwargs, words", [({"mode": "is"}, "rollout_correction='is'"),
                                           ({"cap": 1.0}, "cap C=1.0"), ({"level": "batch"}, "level 'batch'"),
                                           ({"floor": 1.0}, "floor 1.0")])
def test_bad_settings_are_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        rollout_correction(OLD, ROLLOUT, MASK, **kwargs)
