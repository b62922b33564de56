"""The offline DPO loop (seed 2.5): preference pairs, a frozen reference, one step per global batch.

Data: a pairwise dataset preprocessed with ``AlpacaStylePairwiseHandler`` (``chosen_input_ids``,
``chosen_labels``, ``rejected_input_ids``, ``rejected_labels``; labels are -100 on the prompt).
Each pair is split at its first label into prompt and answer and put in the training layout of
:mod:`posttrain.training.forward` twice (``chosen_*`` and ``rejected_*``).

Per global batch of ``global_batch_size`` pairs:

1. the reference's sequence log-probs ``ref_c``, ``ref_r`` (sum over answer tokens; mean for
   ``ipo``), without gradients, from the session's reference engine (the same batching options
   as the policy: remove padding, token budgets); ``orpo`` reads no reference (zeros);
2. one optimizer step on :func:`posttrain.algo.dpo_loss.dpo_loss` (``dpo_loss_type`` sigmoid,
   hinge, ipo, kto_pair or orpo; ``dpo_beta``; ``dpo_label_smoothing``; ``pref_ftx`` adds the chosen
   answer's token-mean NLL), averaged over the pairs of the batch, in micro-batches of
   ``micro_batch_size`` pairs.

The reference is ``ref_model`` when set (an HF directory or checkpoint), else a frozen copy of the
initial policy (none for ``orpo``). Metrics: ``dpo/loss``, ``rewards/chosen``, ``rewards/rejected``
(``beta (logp_policy - logp_ref)``), ``rewards/accuracies``, ``rewards/margins``,
``dpo/grad_norm``, ``dpo/lr``, ``timing/all``.

``dpo_loss_type: kto`` trains on unpaired rows instead: :func:`preference_trainer` (the stage's
loop) then runs :class:`posttrain.loops.kto.KTOTrainer`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from posttrain.algo.dpo_loss import AVERAGED, REFERENCE_FREE
from posttrain.loops.kto import KTOTrainer
from posttrain.loops.offline import OfflineTrainer, labelled_batch
from posttrain.training.loss_fns import make_dpo_loss_fn

if TYPE_CHECKING:
    from posttrain.training.base import AfterForward
    from posttrain.training.loss_fns import PairLossFn

log = logging.getLogger(__name__)
SIDES = ("chosen", "rejected")


def pair_batch(items: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``chosen_*`` and ``rejected_*`` training layouts of a list of pairwise samples."""
    out = {}
    for side in SIDES:
        tensors = labelled_batch([(it[f"{side}_input_ids"], it[f"{side}_labels"]) for it in items], pad_token_id)
        out.update({f"{side}_{k}": v for k, v in tensors.items()})
    return out


def with_loss_metric(loss_fn: PairLossFn) -> PairLossFn:
    """``loss_fn`` reporting the loss itself as ``dpo/loss`` (each micro-batch's share of the batch
    mean), on the pairs (the HF engine's forward) and on the rows (the Megatron engine's)."""
    return replace(loss_fn, after_pairs=_reporting_loss(loss_fn.after_pairs),
                   after_forward=_reporting_loss(loss_fn.after_forward))


def _reporting_loss(after: AfterForward) -> AfterForward:
    def reporting(*outputs, **counts):
        loss, metrics = after(*outputs, **counts)
        return loss, {"dpo/loss": loss.detach(), **metrics}

    return reporting


class DPOTrainer(OfflineTrainer):
    @property
    def batch_phase(self) -> str:  # the timing key of building a batch: it runs the reference, if any
        return "data" if self.plan.dpo.loss_type in REFERENCE_FREE else "reference_model"

    def loss_fn(self):
        o = self.plan.dpo
        return with_loss_metric(make_dpo_loss_fn(beta=o.beta, loss_type=o.loss_type, label_smoothing=o.label_smoothing,
                                                 pref_ftx=o.pref_ftx))

    def batch(self) -> dict[str, torch.Tensor]:
        p = self.s.policy
        batch = pair_batch(self.items(), p.pad_token_id)
        loss_type = self.plan.dpo.loss_type
        if loss_type in REFERENCE_FREE:  # no reference model is built
            chosen = rejected = torch.zeros(batch["chosen_input_ids"].shape[0])
        else:
            chosen, rejected = p.reference.compute_pair_logps(batch, average=loss_type in AVERAGED,
                                                              micro_batch_size=self.plan.policy.optim.micro_batch_size)
        batch.update(ref_chosen_logps=chosen.cpu(), ref_rejected_logps=rejected.cpu())
        return batch


def preference_trainer(plan, session) -> OfflineTrainer:
    """The dpo stage's loop: :class:`KTOTrainer` on unpaired rows (``dpo_loss_type: kto``), else
    :class:`DPOTrainer` on pairs."""
    if plan.dpo.unpaired:
        return KTOTrainer(plan, session)
    return DPOTrainer(plan, session)
