"""Policy-gradient losses (PPO/GRPO/DAPO clipped surrogate, dual-clip, GSPO, CISPO, SAPO, GPG) and the actor loss.

Inputs are per-token ``[B, R]`` tensors of one micro-batch: ``logprobs`` (current policy, with
grad), ``old_logprobs`` (behaviour policy), ``advantages``, ``response_mask``. ``num_tokens`` /
``num_seqs`` are the **mini-batch** counts (see :mod:`posttrain.algo.aggregation`); with them,
every returned metric is this micro-batch's share, so summing the metrics of the micro-batches
gives the mini-batch value. Without them, losses and metrics are this batch's own means.

Policy losses, by name (``policy_loss=``; :data:`POLICY_LOSSES`), each callable alone with
the clip bounds, aggregation mode and counts as keywords:

* ``ppo`` (aliases ``grpo``, ``dapo``; Schulman et al. 2017): ``r = exp(logp - old_logp)``,
  ``L = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; the run's plan resolves the bounds
  once: ``clip_low = clip_high = clip_ratio``, or DAPO's "clip-higher" ``clip_ratio_low`` /
  ``clip_ratio_high`` (Yu et al. 2025).
  With ``clip_ratio_c`` (> 1) the dual-clip of Ye et al. 2020 also bounds negative-advantage
  tokens: ``L = min(L, -A c)`` where ``A < 0``.
* ``gspo`` (Zheng et al. 2025, Group Sequence Policy Optimization): the ratio is the
  sequence-level geometric mean ``s_i = exp(mean_t (logp - old_logp))``, applied per token as
  ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))`` (same value, per-token gradient), clipped like PPO.
  The paper aggregates with ``seq-mean-token-mean`` and uses tiny clip ranges (3e-4/4e-4).
* ``cispo`` (MiniMax 2025, Clipped IS-weight Policy Optimization): ``L = -sg(clip(r, 1 - clip_low,
  1 + clip_high)) A logp``: the importance weight is clipped and detached, so every token keeps a
  gradient (PPO's clip drops the clipped tokens' gradient). Where ``r`` is inside the band the
  gradient equals PPO's.
* ``sapo`` (Gao et al. 2025, Soft Adaptive Policy Optimization): a smooth gate in place of the
  clip, ``L = -A (4 / tau) sigmoid(tau (r - 1))`` with ``tau = tau_pos`` where ``A > 0`` and
  ``tau_neg`` elsewhere (``policy_params``; the paper's 1.0 and 1.05). At ``r = 1`` the gate's slope
  is 1, so the on-policy gradient equals PPO's.
* ``gpg`` (Chu et al. 2025, Group Policy Gradient): plain REINFORCE on the group's advantages,
  ``L = -A logp``, no ratio and no clip (its on-policy gradient equals PPO's too).

Actor loss (the seed's GRPO/DAPO/PPO loss):
``loss = pg + kl_coef * agg(KL_penalty(logp, ref_logp)) - entropy_coeff * agg(H)``.
"""

from __future__ import annotations

import torch

from posttrain.algo.aggregation import aggregate_loss
from posttrain.algo.kl import kl_penalty as kl_penalty_fn
from posttrain.registry import Registry

MAX_LOG_RATIO = 20.0
# fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, clip_ratio_c=None,
#    loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_length=None, **policy_params)
#    -> (loss, metrics); policy_params are the loss's own (sapo: tau_pos, tau_neg)
POLICY_LOSSES = Registry("policy loss", key="rl_config.policy_loss")


def _token_mean(values, mask, num_tokens):
    """A clip-fraction / KL metric: the token mean (this micro-batch's share of the mini-batch's)."""
    return aggregate_loss(values, mask, mode="token-mean", num_tokens=num_tokens).detach()


def _clipped_surrogate(ratio, advantages, mask, num_tokens, *, clip_low, clip_high, clip_ratio_c):
    """Shared PPO clip (+ optional dual clip). Returns the per-token loss and clip metrics."""
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg_losses1, pg_losses2)
    metrics = {"actor/pg_clipfrac": _token_mean((pg_losses2 > pg_losses1).float(), mask, num_tokens)}
    if clip_ratio_c is not None:
        assert clip_ratio_c > 1.0, "clip_ratio_c must be > 1"
        pg_losses3 = -advantages * clip_ratio_c
        lower = (clipped > pg_losses3) & (advantages < 0)
        clipped = torch.where(advantages < 0, torch.minimum(clipped, pg_losses3), clipped)
        metrics["actor/pg_clipfrac_lower"] = _token_mean(lower.float(), mask, num_tokens)
    return clipped, metrics


def _aggregated(per_token, log_ratio, mask, metrics, *, loss_agg_mode, num_tokens, num_seqs, norm_length):
    """The aggregated loss, with ``actor/ppo_kl`` (the token mean of ``old_logp - logp``) added to ``metrics``."""
    metrics["actor/ppo_kl"] = _token_mean(-log_ratio.detach(), mask, num_tokens)
    loss = aggregate_loss(per_token, mask, mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                          norm_length=norm_length)
    return loss, metrics


@POLICY_LOSSES.register("ppo", "grpo", "dapo")
def ppo_clip_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, clip_ratio_c=None,
                  loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_length=None):
    """Token-level PPO clipped surrogate (see module docstring)."""
    mask = mask.to(logprobs.dtype)
    log_ratio = torch.clamp(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    per_token, metrics = _clipped_surrogate(log_ratio.exp(), advantages, mask, num_tokens, clip_low=clip_low,
                                            clip_high=clip_high, clip_ratio_c=clip_ratio_c)
    return _aggregated(per_token, log_ratio, mask, metrics, loss_agg_mode=loss_agg_mode, num_tokens=num_tokens,
                       num_seqs=num_seqs, norm_length=norm_length)


@POLICY_LOSSES.register("gspo")
def gspo_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, clip_ratio_c=None,
              loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_length=None):
    """Sequence-level importance ratio (GSPO-token form; see module docstring)."""
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    token_log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    ratio = torch.clamp(token_log_ratio, max=10.0).exp()
    per_token, metrics = _clipped_surrogate(ratio, advantages, mask, num_tokens, clip_low=clip_low,
                                            clip_high=clip_high, clip_ratio_c=clip_ratio_c)
    return _aggregated(per_token, log_ratio, mask, metrics, loss_agg_mode=loss_agg_mode, num_tokens=num_tokens,
                       num_seqs=num_seqs, norm_length=norm_length)


@POLICY_LOSSES.register("cispo")
def cispo_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, clip_ratio_c=None,
               loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_length=None):
    """The clipped, detached importance weight times the REINFORCE term (see module docstring)."""
    mask = mask.to(logprobs.dtype)
    log_ratio = torch.clamp(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.detach().exp()
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -advantages * weight * logprobs
    metrics = {"actor/pg_clipfrac": _token_mean((weight != ratio).to(mask.dtype), mask, num_tokens)}
    return _aggregated(per_token, log_ratio, mask, metrics, loss_agg_mode=loss_agg_mode, num_tokens=num_tokens,
                       num_seqs=num_seqs, norm_length=norm_length)


@POLICY_LOSSES.register("sapo")
def sapo_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, clip_ratio_c=None,
              loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_length=None, tau_pos=1.0,
              tau_neg=1.05):
    """The soft gate ``(4 / tau) sigmoid(tau (r - 1))`` in place of the clip (see module docstring)."""
    mask = mask.to(logprobs.dtype)
    log_ratio = torch.clamp(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(logprobs.dtype)
    per_token = -advantages * (4.0 / tau) * torch.sigmoid(tau * (log_ratio.exp() - 1.0))
    return _aggregated(per_token, log_ratio, mask, {}, loss_agg_mode=loss_agg_mode, num_tokens=num_tokens,
                       num_seqs=num_seqs, norm_length=norm_length)


@POLICY_LOSSES.register("gpg")
def gpg_loss(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, clip_ratio_c=None,
             loss_agg_mode="token-mean", num_tokens=None, num_seqs=None, norm_length=None):
    """REINFORCE with the group's advantages, no ratio (see module docstring)."""
    mask = mask.to(logprobs.dtype)
    return _aggregated(-advantages * logprobs, logprobs - old_logprobs, mask, {}, loss_agg_mode=loss_agg_mode,
                       num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)


def actor_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    policy_loss: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    policy_params: dict[str, float] | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_penalty: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    num_tokens: torch.Tensor | float | None = None,
    num_seqs: torch.Tensor | float | None = None,
    norm_length: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``pg + kl_coef * KL - entropy_coeff * H`` (GRPO puts the KL in the loss; DAPO/PPO pass no ref).

    ``pg`` is the policy loss registered as ``policy_loss``, clipped to ``[1 - clip_low,
    1 + clip_high]``, dual-clipped with ``clip_ratio_c``, given ``policy_params`` (its own keywords).
    ``norm_length``: the constant length of ``loss_agg_mode="seq-mean-token-sum-norm"``. Metrics
    use the seed's names: ``actor/pg_loss`` (the policy-gradient term only; the seed logs
    ``|total loss|``, quirk 1), ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``
    (with ``clip_ratio_c``), ``actor/kl_loss`` (when ``ref_logprobs`` is given), ``actor/entropy``
    (when ``entropy`` is given).
    """
    counts = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_length": norm_length}
    mask = response_mask.to(logprobs.dtype)
    pg, metrics = POLICY_LOSSES.get(policy_loss)(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
        loss_agg_mode=loss_agg_mode,
        **counts,
        **(policy_params or {}),
    )
    metrics["actor/pg_loss"] = pg.detach()
    loss = pg
    if ref_logprobs is not None:
        kl_mat = kl_penalty_fn(logprobs, ref_logprobs, kl_penalty=kl_penalty)
        kl = aggregate_loss(kl_mat, mask, mode=loss_agg_mode, **counts)
        metrics["actor/kl_loss"] = kl.detach()
        loss = loss + kl_coef * kl
    if entropy is not None:
        ent = aggregate_loss(entropy, mask, mode=loss_agg_mode, **counts)
        metrics["actor/entropy"] = ent.detach()
        if entropy_coeff:
            loss = loss - entropy_coeff * ent
    return loss, metrics
