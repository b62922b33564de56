"""KTO, Kahneman-Tversky Optimisation (Ethayarajh et al. 2024), on unpaired preference rows.

Each row is a prompt ``x``, a completion ``y`` and a label: desirable (``d = 1``) or undesirable
(``d = 0``). With sequence log-probs (sums over the completion's tokens) under the policy and the
frozen reference, the implied reward is ``r(x, y) = log pi(y|x) - log pi_ref(y|x)``. The reference
point ``z0`` estimates the policy's KL from the reference on *mismatched* pairs: each prompt with
another row's completion (the batch's completions shifted by one row),
``z0 = max(0, mean_j(log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)))``, and carries no gradient. Per row::

    desirable:    lambda_D (1 - sigma(beta (r - z0)))
    undesirable:  lambda_U (1 - sigma(beta (z0 - r)))

``loss = sum_i loss_i / num_rows`` (``num_rows``: the rows of the mini-batch; default this batch's).
``beta`` is ``dpo_beta``; ``lambda_D`` / ``lambda_U`` are ``kto_desirable_weight`` /
``kto_undesirable_weight``. The paper advises ``lambda_D n_D / (lambda_U n_U)`` in ``[1, 4/3]``
(``n_D``, ``n_U``: the desirable and undesirable rows): :func:`weight_balance_advice`.

Metrics (shares of the mini-batch's values, which the engine sums over micro-batches):
``rewards/chosen`` = mean of ``beta r`` over the desirable rows (``num_desirable`` of them in the
mini-batch), ``rewards/rejected`` = mean over the undesirable rows (``num_undesirable``).
"""

from __future__ import annotations

import torch

KTO = "kto"  # the dpo_loss_type that trains on unpaired rows with this loss
BALANCE_RANGE = (1.0, 4.0 / 3.0)  # the paper's range of lambda_D n_D / (lambda_U n_U)


def kto_reference_point(policy_mismatched_logps: torch.Tensor, ref_mismatched_logps: torch.Tensor) -> torch.Tensor:
    """``z0 = max(0, mean(policy - ref))`` over the mismatched pairs ``[M]``, without gradient (0-d)."""
    return (policy_mismatched_logps - ref_mismatched_logps).detach().mean().clamp(min=0)


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    num_rows: torch.Tensor | float | None = None,
    num_desirable: torch.Tensor | float | None = None,
    num_undesirable: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KTO loss over rows ``[N]`` (module docstring) and its ``rewards/*`` metrics.

    ``desirable [N]`` is 1 for a desirable row, 0 for an undesirable one; ``reference_point`` is
    ``z0`` (:func:`kto_reference_point`). The counts default to this batch's."""
    desirable = desirable.to(policy_logps.dtype)
    ratio = policy_logps - ref_logps
    z0 = torch.as_tensor(reference_point, dtype=ratio.dtype, device=ratio.device).detach()
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio)))
    losses = desirable * desirable_losses + (1 - desirable) * undesirable_losses
    rows = float(losses.shape[0]) if num_rows is None else num_rows
    n_desirable = desirable.sum() if num_desirable is None else num_desirable
    n_undesirable = (1 - desirable).sum() if num_undesirable is None else num_undesirable
    rewards = beta * ratio.detach()
    metrics = {
        "rewards/chosen": (rewards * desirable).sum() / torch.clamp(torch.as_tensor(n_desirable), min=1),
        "rewards/rejected": (rewards * (1 - desirable)).sum() / torch.clamp(torch.as_tensor(n_undesirable), min=1),
    }
    return losses.sum() / rows, metrics


def weight_balance_advice(num_desirable: int, num_undesirable: int, desirable_weight: float,
                          undesirable_weight: float) -> str | None:
    """A warning when ``lambda_D n_D / (lambda_U n_U)`` lies outside the paper's ``[1, 4/3]``, with
    the weights that would bring it back; None inside the range (or with a class absent)."""
    if num_desirable == 0 or num_undesirable == 0:
        return None
    balance = desirable_weight * num_desirable / (undesirable_weight * num_undesirable)
    low, high = BALANCE_RANGE
    if low <= balance <= high:
        return None
    base = undesirable_weight * num_undesirable / num_desirable
    return (f"KTO: kto_desirable_weight x desirable rows / (kto_undesirable_weight x undesirable rows) = "
            f"{desirable_weight} x {num_desirable} / ({undesirable_weight} x {num_undesirable}) = {balance:.3f}, "
            f"outside the paper's advised range [1, 4/3]; e.g. set kto_desirable_weight in "
            f"[{base * low:.3g}, {base * high:.3g}]")
