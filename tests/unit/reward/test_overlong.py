"""DAPO overlong penalty (seed_system.md 2.3), values checked by hand."""

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.reward.overlong import overlong_penalty


def test_values_by_hand():
    # max 20, buffer 8 -> expected 12; factor 0.5
    # L=5: exceed -7 -> min(7/8*0.5, 0) = 0;  L=12: 0;  L=16: exceed 4 -> -4/8*0.5 = -0.25
    # L=20: exceed 8 -> -0.5;  L=30: exceed min(18, 8) = 8 -> -0.5
    got = overlong_penalty([5, 12, 16, 20, 30], max_tokens=20, overlong_buffer=8, penalty_factor=0.5)
    assert got == [0.0, 0.0, -0.25, -0.5, -0.5]


def test_tensor_input_matches_list():
    lengths = [3, 13, 15, 17, 40]
    ref = overlong_penalty(lengths, 16, 4, 1.0)
    out = overlong_penalty(torch.tensor(lengths), 16, 4, 1.0)
    assert isinstance(out, torch.Tensor)
    assert out.tolist() == pytest.approx(ref)
    assert ref == [0.0, -0.25, -0.75, -1.0, -1.0]


@pytest.mark.parametrize("buffer", [0, 16, 20])
def test_invalid_buffer(buffer):
    with pytest.raises(ConfigError, match="overlong_buffer"):
        overlong_penalty([1], max_tokens=16, overlong_buffer=buffer, penalty_factor=1.0)
