"""Turn-level credit for multi-turn rollouts (``rl_config.turn_credit: turn``).

A multi-turn response alternates assistant turns (sampled tokens, ``response_mask`` 1) with tool
outputs (``response_mask`` 0). Turn ``k`` of a row is its ``k``-th run of sampled tokens.

* Rewards per turn: ``r_k``. The trajectory's score is the reward of the row's last turn; earlier
  turns earn 0 (:func:`final_turn_rewards`), so a turn's credit is what the turns after it earn.
* Returns per turn: ``G_t = sum_{k >= t} gamma^(k - t) r_k`` (:func:`turn_returns`).
* Advantages per turn, normalised per turn index across the prompt's group
  (:func:`group_turn_advantages`): among the rows of a group that have a turn ``t``,
  ``A_t = (G_t - mean_t) / (std_t + eps)`` (``group_norm``) or ``G_t - mean_t`` (``grpo_no_std``);
  a turn index only one row of the group reaches gets 0 (nothing to compare it with).
* Every sampled token of turn ``t`` gets ``A_t``; tool tokens and padding get 0.

The trajectory-level default (``turn_credit: trajectory``) is :mod:`posttrain.algo.advantages`.
"""

from __future__ import annotations

import torch

from posttrain.algo.advantages import GROUP_NORM_EPS
from posttrain.errors import ConfigError

TURN_CREDITS = ("trajectory", "turn")
# the estimators with a turn-level form, and whether they divide by the group std
TURN_ESTIMATORS = {"group_norm": True, "grpo": True, "grpo_no_std": False, "dr_grpo": False}


def turn_index(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, R]`` long: the turn of each sampled token (0, 1, ...), -1 on tool tokens and padding."""
    sampled = response_mask > 0
    before = torch.zeros_like(sampled)
    before[:, 1:] = sampled[:, :-1]
    starts = sampled & ~before  # the first token of each run of sampled tokens
    index = starts.long().cumsum(-1) - 1
    return torch.where(sampled, index, torch.full_like(index, -1))


def final_turn_rewards(scores: torch.Tensor, num_turns: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float64 (``T = max(num_turns)``): each row's score on its last turn, 0 elsewhere."""
    width = max(int(num_turns.max()) if num_turns.numel() else 0, 1)
    rewards = torch.zeros((len(scores), width), dtype=torch.float64)
    rows = torch.nonzero(num_turns > 0).squeeze(-1)
    rewards[rows, num_turns[rows] - 1] = scores.to(torch.float64)[rows]
    return rewards


def turn_returns(rewards: torch.Tensor, num_turns: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = sum_{k >= t} gamma^(k - t) r_k`` over each row's turns (``[B, T]``; 0 past its last turn)."""
    has = torch.arange(rewards.shape[1])[None, :] < num_turns[:, None]
    rewards = torch.where(has, rewards.to(torch.float64), 0.0)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(has, returns, 0.0)


def group_turn_advantages(returns: torch.Tensor, num_turns: torch.Tensor, group_size: int, *,
                          divide_by_std: bool = True, eps: float = GROUP_NORM_EPS) -> torch.Tensor:
    """``[B, T]``: each turn's return normalised over the group's rows that have that turn index."""
    if group_size < 1 or returns.shape[0] % group_size:
        raise ConfigError(f"{returns.shape[0]} responses cannot be split into groups of "
                          f"rl_config.n_samples_per_prompt={group_size}; the batch must hold whole groups.")
    has = (torch.arange(returns.shape[1])[None, :] < num_turns[:, None]).to(torch.float64)
    width = returns.shape[1]
    g_returns = returns.to(torch.float64).reshape(-1, group_size, width)
    g_has = has.reshape(-1, group_size, width)
    count = g_has.sum(1, keepdim=True)
    mean = (g_returns * g_has).sum(1, keepdim=True) / count.clamp(min=1)
    centred = (g_returns - mean) * g_has
    advantages = centred
    if divide_by_std:  # the unbiased std over the rows that have the turn, as group_norm's
        std = ((centred ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        advantages = centred / (std + eps)
    advantages = torch.where(count > 1, advantages, 0.0)  # one row alone at a turn index: no baseline
    return advantages.reshape(-1, width)


def turn_level_advantages(estimator: str, scores: torch.Tensor, response_mask: torch.Tensor, *, group_size: int,
                          gamma: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) ``[B, R]`` float32: every sampled token gets its turn's advantage and
    return (see the module docstring); ``scores [B]`` are the trajectories' scores."""
    if estimator not in TURN_ESTIMATORS:
        raise ConfigError(f"rl_config.turn_credit: turn works with adv_estimator {', '.join(TURN_ESTIMATORS)}, not "
                          f"{estimator!r}; choose one of them or set turn_credit: trajectory")
    turns = turn_index(response_mask)
    num_turns = turns.max(-1).values + 1
    returns = turn_returns(final_turn_rewards(scores, num_turns), num_turns, gamma)
    advantages = group_turn_advantages(returns, num_turns, group_size, divide_by_std=TURN_ESTIMATORS[estimator])
    return _per_token(advantages, turns), _per_token(returns, turns)


def _per_token(per_turn: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` -> ``[B, R]`` float32 by each token's turn; 0 where the turn is -1."""
    picked = per_turn.gather(1, turns.clamp(min=0))
    return torch.where(turns >= 0, picked, 0.0).to(torch.float32)
