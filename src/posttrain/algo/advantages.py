"""Advantage estimators, selected by name (``rl_config.adv_estimator``).

Each estimator is ``fn(token_level_rewards [B, R], response_mask [B, R], *, <its keywords>)
-> (advantages [B, R], returns [B, R])`` and takes only the keywords it uses (``group_size``,
``gamma``, ``lam``, ``values``, ``whiten``); a keyword it does not use raises TypeError. A training
loop calls :func:`compute_advantages`, which passes each estimator the config values it accepts.

``token_level_rewards`` holds the outcome score at the last valid response token (see
:func:`scores_to_token_level_rewards`) plus, optionally, a per-token KL penalty. Outcome-based
estimators use the row sum ``r = sum_t token_level_rewards`` as the sequence score. Rows of a
prompt group are contiguous: rows ``g*G .. g*G+G-1`` share a prompt (``G = group_size``, the
seed's ``n_samples_per_prompt`` layout). Advantages are zero on padding.

Names: ``group_norm`` (alias ``grpo``), ``grpo_no_std`` (alias ``dr_grpo``), ``rloo``,
``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``gae``.
"""

from __future__ import annotations

import inspect

import torch

from posttrain.algo.masked import masked_whiten
from posttrain.errors import ConfigError
from posttrain.registry import Registry

GROUP_NORM_EPS = 1e-6
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", key="rl_config.adv_estimator")


def compute_advantages(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_size: int,
    gamma: float,
    lam: float,
    values: torch.Tensor | None = None,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name`` with those of these keywords it accepts.

    ``values`` (critic values ``[B, R]``) and ``whiten`` are used by ``gae`` only, ``lam`` too;
    ``group_size`` by the group estimators, ``gamma`` by the discounting ones.
    """
    estimator = ADVANTAGE_ESTIMATORS.get(name)
    offered = {"values": values, "group_size": group_size, "gamma": gamma, "lam": lam, "whiten": whiten}
    accepted = inspect.signature(estimator).parameters
    return estimator(token_level_rewards, response_mask, **{k: v for k, v in offered.items() if k in accepted})


def scores_to_token_level_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar score at its last valid response token (zeros elsewhere).

    ``scores [B]``, ``response_mask [B, R]`` -> ``[B, R]`` float32. A row with no valid token
    gets no reward.
    """
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    valid = response_mask > 0
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    # the last valid position (not count - 1: a multi-turn mask has holes for tool output)
    last = torch.where(valid, positions, -1).max(-1).values
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = scores.to(torch.float32)[rows]
    return rewards


def _grouped_scores(token_level_rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Row scores in float64 as ``[num_groups, G]``."""
    num_rows = token_level_rewards.shape[0]
    if group_size < 1 or num_rows % group_size:
        raise ConfigError(
            f"{num_rows} responses cannot be split into groups of "
            f"rl_config.n_samples_per_prompt={group_size}; the batch must hold whole groups."
        )
    return token_level_rewards.to(torch.float64).sum(-1).reshape(-1, group_size)


def _broadcast(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` -> ``[B, R]`` float32, zero on padding."""
    mask = response_mask.to(torch.float32)
    return per_row.reshape(-1, 1).to(torch.float32) * mask


def discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """``G_t = sum_{k >= t} gamma^(k - t) r_k`` over valid tokens (reverse scan)."""
    mask = response_mask.to(torch.float32)
    rewards = token_level_rewards.to(torch.float32) * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        # masked positions (padding, tool output) neither add reward nor break the chain
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


@ADVANTAGE_ESTIMATORS.register("group_norm", "grpo")
def group_norm(token_level_rewards, response_mask, *, group_size=1, eps=GROUP_NORM_EPS):
    """GRPO (Shao et al. 2024, DeepSeekMath): ``A_i = (r_i - mean_g) / (std_g + eps)``.

    ``std`` is the unbiased group standard deviation (torch's default) computed in float64,
    ``eps = 1e-6`` as in the seed; the result is broadcast to every valid response token.
    ``returns = advantages``. A group of identical rewards gives 0; a group of size 1 gives 0.
    Seed unit test: rewards [1, 2], G=2 -> [-0.7071, 0.7071].
    """
    scores = _grouped_scores(token_level_rewards, group_size)
    mean = scores.mean(-1, keepdim=True)
    std = scores.std(-1, keepdim=True) if group_size > 1 else torch.ones_like(mean)
    advantages = _broadcast((scores - mean) / (std + eps), response_mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("grpo_no_std", "dr_grpo")
def grpo_no_std(token_level_rewards, response_mask, *, group_size=1):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``A_i = r_i - mean_g``.

    No division by the group std (which up-weights easy/hard prompts). ``returns = advantages``.
    """
    scores = _grouped_scores(token_level_rewards, group_size)
    advantages = _broadcast(scores - scores.mean(-1, keepdim=True), response_mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(token_level_rewards, response_mask, *, group_size=1):
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline.

    ``A_i = r_i - (sum_g r - r_i) / (G - 1) = G / (G - 1) * (r_i - mean_g)``. Needs G >= 2.
    """
    if group_size < 2:
        raise ConfigError(
            "adv_estimator 'rloo' needs rl_config.n_samples_per_prompt >= 2 "
            f"(got {group_size}); raise n_samples_per_prompt or choose another estimator."
        )
    scores = _grouped_scores(token_level_rewards, group_size)
    baseline = (scores.sum(-1, keepdim=True) - scores) / (group_size - 1)
    advantages = _broadcast(scores - baseline, response_mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(token_level_rewards, response_mask, *, gamma=1.0):
    """REINFORCE++ (Hu 2025): discounted returns, whitened over the whole batch.

    ``G_t = sum_{k>=t} gamma^(k-t) r_k`` (``r`` may include a per-token KL penalty);
    ``A = masked_whiten(G)`` over all valid tokens of the batch; ``returns = G``.
    """
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    mask = response_mask.to(torch.float32)
    return masked_whiten(returns, mask) * mask, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(token_level_rewards, response_mask, *, group_size=1, gamma=1.0):
    """REINFORCE++-baseline (Hu 2025): subtract the group-mean score, then whiten over the batch.

    The group mean of row scores is subtracted at each row's last valid token, then discounted
    returns ``G_t`` are computed and ``A = masked_whiten(G)`` over the batch; ``returns = G``.
    """
    scores = _grouped_scores(token_level_rewards, group_size)
    baseline = scores.mean(-1, keepdim=True).expand_as(scores).reshape(-1)
    shaped = token_level_rewards.to(torch.float32) - scores_to_token_level_rewards(
        baseline, response_mask
    )
    return reinforce_plus_plus(shaped, response_mask, gamma=gamma)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae(token_level_rewards, response_mask, *, values=None, gamma=1.0, lam=1.0, whiten=True):
    """Generalised Advantage Estimation (Schulman et al. 2016), as the seed's PPO.

    Reverse scan over valid tokens (masked ones are skipped, so multi-turn tool output does
    not cut the chain): ``delta_t = r_t + gamma * V_{t+1} - V_t`` (0 past the last token),
    ``gae_t = delta_t + gamma * lam * gae_{t+1}``; ``returns = gae + V``;
    ``advantages = masked_whiten(gae)`` over the batch (unbiased variance). Seed unit test:
    r=[1,2,3], V=[.5,1,1.5], gamma=0 -> advantages [-1,0,1], returns [1,2,3].
    """
    if values is None:
        raise ConfigError(
            "adv_estimator 'gae' needs critic values; it is only valid for PPO (with a critic)."
        )
    mask = response_mask.to(torch.float32)
    rewards = token_level_rewards.to(torch.float32) * mask
    values = values.to(torch.float32) * mask
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t] > 0  # masked positions are skipped: the scan carries over them
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(valid, delta + gamma * lam * running, running)
        next_value = torch.where(valid, values[:, t], next_value)
        advantages[:, t] = running
    advantages = advantages * mask
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


