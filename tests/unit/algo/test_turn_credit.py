"""Turn-level credit (posttrain.algo.turn_credit) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from posttrain.algo.advantages import group_norm, scores_to_token_level_rewards
from posttrain.algo.turn_credit import (final_turn_rewards, group_turn_advantages, turn_index, turn_level_advantages,
                                        turn_returns)
from posttrain.errors import ConfigError

# two rows of one group, two assistant turns each: turn, tool tokens, turn, padding
MASK = torch.tensor([[1, 1, 0, 0, 1, 1, 0],
                     [1, 0, 1, 1, 1, 0, 0]])
ROW0 = (0, 0, -1, -1, 1, 1, -1)
ROW1 = (0, -1, 1, 1, 1, -1, -1)


def test_turns_are_the_runs_of_sampled_tokens():
    assert turn_index(MASK).tolist() == [list(ROW0), list(ROW1)]
    assert turn_index(torch.tensor([[0, 1, 0, 1, 0, 1]])).tolist() == [[-1, 0, -1, 1, -1, 2]]


def test_returns_discount_the_later_turns_rewards():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
    # row 0: G_2 = 2, G_1 = 0 + .5 * 2 = 1, G_0 = 1 + .5 * 1 = 1.5; row 1 has one turn
    assert turn_returns(rewards, torch.tensor([3, 1]), gamma=0.5).tolist() == [[1.5, 1.0, 2.0], [3.0, 0.0, 0.0]]
    assert final_turn_rewards(torch.tensor([4.0, 5.0]), torch.tensor([2, 1])).tolist() == [[0.0, 4.0], [5.0, 0.0]]


def test_only_the_second_turn_rewarded_credits_the_first_by_gamma():
    # scores [1, 0]: returns row 0 [.5, 1], row 1 [0, 0]; no std: turn 0 +-.25, turn 1 +-.5
    adv, ret = turn_level_advantages("grpo_no_std", torch.tensor([1.0, 0.0]), MASK, group_size=2, gamma=0.5)
    per_turn = {0: 0.25, 1: 0.5, -1: 0.0}
    assert adv[0].tolist() == pytest.approx([per_turn[t] for t in ROW0])
    assert adv[1].tolist() == pytest.approx([-per_turn[t] for t in ROW1])
    assert ret[0].tolist() == pytest.approx([{0: 0.5, 1: 1.0, -1: 0.0}[t] for t in ROW0])
    # group_norm: each turn index normalised on its own, +-1/sqrt(2) on both turns
    adv, _ = turn_level_advantages("group_norm", torch.tensor([1.0, 0.0]), MASK, group_size=2, gamma=0.5)
    assert adv[0].tolist() == pytest.approx([0.0 if t < 0 else 0.5 ** 0.5 for t in ROW0], abs=1e-5)


def test_turn_indexes_are_compared_only_among_rows_that_reach_them():
    # a group of 3: one turn scoring 1; two turns scoring 1; two turns scoring 0 (gamma 1, no std)
    returns = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    adv = group_turn_advantages(returns, torch.tensor([1, 2, 2]), 3, divide_by_std=False)
    assert adv.flatten().tolist() == pytest.approx([1 / 3, 0.0, 1 / 3, 0.5, -2 / 3, -0.5])
    # a turn index only one row of the group reaches has no baseline: 0
    adv = group_turn_advantages(torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), torch.tensor([3, 1]), 2)
    assert adv[0, 1:].tolist() == [0.0, 0.0] and adv[0, 0] > 0


def test_same_turn_counts_and_no_discount_give_the_trajectory_advantages():
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 1], [1, 0, 0, 1], [1, 1, 0, 1]])
    turn, _ = turn_level_advantages("group_norm", scores, mask, group_size=2)
    trajectory, _ = group_norm(scores_to_token_level_rewards(scores, mask), mask, group_size=2)
    assert torch.allclose(turn, trajectory * mask, atol=1e-6)


def test_an_estimator_without_a_turn_form_is_refused():
    with pytest.raises(ConfigError, match="turn_credit"):
        turn_level_advantages("rloo", torch.tensor([1.0, 0.0]), MASK, group_size=2)
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        turn_level_advantages("group_norm", torch.tensor([1.0, 0.0]), MASK, group_size=3)
