"""Direct Preference Optimisation losses (Rafailov et al. 2023) and variants, selected by name.

Inputs are per-pair sequence log-probs ``[N]``: the sum of the response-token log-probs of the
chosen / rejected answer under the policy and the frozen reference (for ``ipo`` the caller
passes length-normalised log-probs, i.e. divided by the number of response tokens, as the seed).
With ``pi = pol_c - pol_r``, ``rho = ref_c - ref_r``, ``z = pi - rho``, ``beta = dpo_beta``
(seed default 0.1), ``ls = label_smoothing`` (default 0):

* ``sigmoid`` (default): ``-log sigma(beta z) (1 - ls) - log sigma(-beta z) ls``
  (conservative DPO / cDPO when ``ls > 0``)
* ``hinge`` (SLiC, Zhao et al. 2023): ``relu(1 - beta z)``
* ``ipo`` (Azar et al. 2023): ``(z - 1 / (2 beta))^2``
* ``orpo`` (Hong et al. 2024, odds-ratio preference optimisation; no reference model): with the
  length-averaged log-probs ``a_c = pol_c``, ``a_r = pol_r`` (the caller averages, as for ``ipo``),
  ``log_odds(a) = a - log(1 - exp(a))`` and ``L_OR = -log sigma(log_odds(a_c) - log_odds(a_r))``,
  the per-pair loss is the chosen answer's NLL plus ``beta L_OR``: ``-a_c + beta L_OR`` (``beta`` is
  the paper's ``lambda``; the reference inputs are zeros and unused).
* ``kto_pair`` (Ethayarajh et al. 2024, paired form): ``kl_c = mean(pol_c - ref_c).clamp(min=0)``,
  ``kl_r`` likewise; per pair ``(1 - sigma(beta (d_c - kl_r)) + 1 - sigma(beta (kl_c - d_r))) / 2``
  with ``d_c = pol_c - ref_c``, ``d_r = pol_r - ref_r`` (the mean is over this micro-batch).

Optional SFT term (seed ``pref_ftx``): ``loss_i += pref_ftx * chosen_nll_i``.
``loss = sum_i loss_i / num_pairs`` (``num_pairs`` = pairs in the mini-batch; default this batch).
Metrics (shares of the mini-batch mean): ``rewards/chosen`` = ``beta (pol_c - ref_c)``,
``rewards/rejected``, ``rewards/accuracies`` = ``1[chosen > rejected]``, ``rewards/margins``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.registry import Registry

# per-pair losses fn(pol_c, pol_r, ref_c, ref_r, *, beta, label_smoothing) -> [N]
DPO_LOSSES = Registry("DPO loss", key="megatron_training.dpo_loss_type")
AVERAGED = ("ipo", "orpo")  # the losses that take length-averaged sequence log-probs
REFERENCE_FREE = ("orpo",)  # the losses that read no reference model


@DPO_LOSSES.register("sigmoid")
def _sigmoid(pol_c, pol_r, ref_c, ref_r, *, beta, label_smoothing):
    z = (pol_c - pol_r) - (ref_c - ref_r)
    return -F.logsigmoid(beta * z) * (1 - label_smoothing) - F.logsigmoid(-beta * z) * label_smoothing


@DPO_LOSSES.register("hinge")
def _hinge(pol_c, pol_r, ref_c, ref_r, *, beta, label_smoothing):
    z = (pol_c - pol_r) - (ref_c - ref_r)
    return torch.relu(1 - beta * z)


@DPO_LOSSES.register("ipo")
def _ipo(pol_c, pol_r, ref_c, ref_r, *, beta, label_smoothing):
    z = (pol_c - pol_r) - (ref_c - ref_r)
    return (z - 1 / (2 * beta)).square()


@DPO_LOSSES.register("kto_pair")
def _kto_pair(pol_c, pol_r, ref_c, ref_r, *, beta, label_smoothing):
    chosen_ratio = pol_c - ref_c
    rejected_ratio = pol_r - ref_r
    chosen_kl = chosen_ratio.mean().clamp(min=0)
    rejected_kl = rejected_ratio.mean().clamp(min=0)
    chosen_loss = 1 - torch.sigmoid(beta * (chosen_ratio - rejected_kl))
    rejected_loss = 1 - torch.sigmoid(beta * (chosen_kl - rejected_ratio))
    return (chosen_loss + rejected_loss) / 2


@DPO_LOSSES.register("orpo")
def _orpo(pol_c, pol_r, ref_c, ref_r, *, beta, label_smoothing):
    def log_odds(avg_logp):  # log(p / (1 - p)) of p = exp(avg_logp), stable as p -> 1
        avg_logp = avg_logp.clamp(max=-1e-7)
        return avg_logp - torch.log(-torch.expm1(avg_logp))

    return -pol_c - beta * F.logsigmoid(log_odds(pol_c) - log_odds(pol_r))


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    pref_ftx: float = 0.0,
    chosen_nll: torch.Tensor | None = None,
    num_pairs: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The named DPO loss averaged over pairs, and the ``rewards/*`` metrics (module docstring)."""
    losses = DPO_LOSSES.get(loss_type)(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta=beta,
        label_smoothing=label_smoothing,
    )
    if pref_ftx > 1e-6:
        assert chosen_nll is not None, "pref_ftx needs chosen_nll"
        losses = losses + pref_ftx * chosen_nll
    denom = float(losses.shape[0]) if num_pairs is None else num_pairs
    chosen_rewards = (beta * (policy_chosen_logps - ref_chosen_logps)).detach()
    rejected_rewards = (beta * (policy_rejected_logps - ref_rejected_logps)).detach()
    metrics = {
        "rewards/chosen": chosen_rewards.sum() / denom,
        "rewards/rejected": rejected_rewards.sum() / denom,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum() / denom,
        "rewards/margins": (chosen_rewards - rejected_rewards).sum() / denom,
    }
    return losses.sum() / denom, metrics
