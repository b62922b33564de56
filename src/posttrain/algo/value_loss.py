"""Clipped value (critic) loss for PPO.

``v_clip = clamp(v, v_old - c, v_old + c)`` with ``c = cliprange_value`` (seed default 0.5);
``vf_loss = 0.5 * agg(max((v - R)^2, (v_clip - R)^2))``;
``vf_clipfrac = token-mean(1[(v_clip - R)^2 > (v - R)^2])``
(Schulman et al. 2017; the clipped form as in OpenAI baselines / the seed's CriticLossFunc).
Shapes ``[B, R]``; counts as in :mod:`posttrain.algo.aggregation`.
"""

from __future__ import annotations

import torch

from posttrain.algo.aggregation import aggregate_loss


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
    loss_agg_mode: str = "token-mean",
    num_tokens: torch.Tensor | float | None = None,
    num_seqs: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss; metrics ``critic/vf_loss``, ``critic/vf_clipfrac``."""
    mask = response_mask.to(values.dtype)
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    losses1 = (values - returns).square()
    losses2 = (clipped_values - returns).square()
    loss = 0.5 * aggregate_loss(
        torch.maximum(losses1, losses2), mask, mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs
    )
    clipfrac = aggregate_loss((losses2 > losses1).float(), mask, mode="token-mean", num_tokens=num_tokens)
    return loss, {"critic/vf_loss": loss.detach(), "critic/vf_clipfrac": clipfrac.detach()}
