"""Rollout correction: importance weights between the trainer's old policy and the rollout's.

The rollout engine samples with ``pi_rollout``: weights some versions older than the trainer's
(asynchronous training, partial rollout), or other numerics (bf16 against fp32, another engine).
The update's ratio is taken against ``pi_old``, the trainer's log-probs of the same tokens. Per
response token::

    rho = exp(old_logprobs - rollout_logprobs)

* ``none``: weights 1, mask unchanged (the mismatch is only measured).
* ``tis``, truncated importance sampling (Ionides 2008; for RL rollouts: Yao et al. 2025, "Your
  efficient RL framework secretly brings you off-policy RL training"): weight ``min(rho, C)``.
* ``mis``, masked importance sampling: weight 1, and the tokens with ``rho`` outside the band
  ``[F, C]`` (``F = floor``, default ``1/C``) leave the loss. With ``level="sequence"`` a
  sequence's ratio is the geometric mean of its tokens' (``exp(mean(log rho))``, so long and short
  sequences compare), and the whole sequence leaves the loss when that is outside the band.
* ``icepop`` (Ling Team 2025, "Every Step Evolves", the Ring-1T report): weight ``rho`` inside the band
  ``[F, C]`` and 0 outside (the paper's band is ``[0.5, 5]``): the tokens whose training and
  inference probabilities disagree too much leave the loss, the others are importance-weighted.

Metrics, over response tokens: ``rollout/logprob_diff_{mean,max}`` (``|old - rollout|``),
``rollout/ratio_{mean,max}`` (``rho``) and ``rollout/masked_fraction`` (the share of tokens that
``mis`` or ``icepop`` took out; 0 otherwise).

Example (tokens of one row, C = 2)::

    old = [-1.0, -2.0, -0.5]; rollout = [-1.0, -3.0, -0.4]    rho = [1, e, e^-0.1]
    tis: weights [1, 2, 0.905]     mis (token): mask [1, 0, 1]     icepop: weights [1, 0, 0.905]
"""

from __future__ import annotations

import math

import torch

from posttrain.algo.masked import masked_mean
from posttrain.errors import ConfigError

MODES = ("none", "tis", "mis", "icepop")
LEVELS = ("token", "sequence")


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, *,
                       mode: str = "none", cap: float = 2.0, level: str = "token",
                       floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(weights [B, T], mask [B, T], metrics)`` for logprobs ``[B, T]`` (see the module docstring).

    ``weights`` multiply the per-token policy loss; ``mask`` replaces ``response_mask`` in it.
    """
    if mode not in MODES:
        raise ConfigError(f"rl_config.rollout_correction={mode!r}: must be one of {', '.join(MODES)}")
    if level not in LEVELS:
        raise ConfigError(f"rollout correction level {level!r}: must be one of {', '.join(LEVELS)}")
    if not cap > 1.0 or not math.isfinite(cap):
        raise ConfigError(f"rollout correction cap C={cap}: must be a finite number > 1")
    floor = 1.0 / cap if floor is None else floor
    if not 0.0 < floor < 1.0:
        raise ConfigError(f"rollout correction floor {floor}: must be in (0, 1)")
    mask = response_mask.to(old_logprobs.dtype)
    log_rho = ((old_logprobs - rollout_logprobs) * mask).detach()
    rho = torch.exp(log_rho)
    weights = torch.ones_like(rho)
    keep = mask.clone()
    if mode == "tis":
        weights = rho.clamp(max=cap)
    elif mode in ("mis", "icepop"):
        if level == "sequence":
            seq = torch.exp(masked_mean(log_rho, mask, dim=-1))[:, None].expand_as(rho)
            inside = (seq >= floor) & (seq <= cap)
        else:
            inside = (rho >= floor) & (rho <= cap)
        keep = mask * inside.to(mask.dtype)
        if mode == "icepop":
            weights = rho * keep
    return weights * mask, keep, _metrics(log_rho, rho, mask, keep)


def _metrics(log_rho: torch.Tensor, rho: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    valid = mask.bool()
    if not bool(valid.any()):
        return {}
    diff = log_rho.abs()[valid]
    ratios = rho[valid]
    return {"rollout/logprob_diff_mean": diff.mean().item(), "rollout/logprob_diff_max": diff.max().item(),
            "rollout/ratio_mean": ratios.mean().item(), "rollout/ratio_max": ratios.max().item(),
            "rollout/masked_fraction": 1.0 - (keep.sum() / mask.sum()).item()}
