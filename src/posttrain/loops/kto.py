"""The offline KTO loop (``stage: dpo`` with ``dpo_loss_type: kto``): unpaired preference rows, a
frozen reference, one optimizer step per global batch.

Data: an unpaired dataset preprocessed with ``UnpairedPreferenceHandler`` (``input_ids``,
``labels`` -100 on the prompt, ``desirable`` 1 / 0). Per global batch of ``global_batch_size`` rows:

1. the *mismatched* rows: row ``i``'s prompt with row ``i - 1``'s completion (the completions
   shifted by one, cyclically, as TRL's KTOTrainer does within a batch);
2. the reference's sequence log-probs (sums over completion tokens) of the matched and the
   mismatched rows (one pair per row for :meth:`compute_pair_logps`: the two share the prompt),
   and the policy's of the mismatched rows, without gradients; the KL reference point
   ``z0 = max(0, mean(policy - reference))`` over the mismatched rows of the whole global batch;
3. one optimizer step on :func:`posttrain.algo.kto_loss.kto_loss` over the matched rows
   (``dpo_beta``, ``kto_desirable_weight``, ``kto_undesirable_weight``), in micro-batches.

``z0`` is taken over the global batch (TRL takes it per device batch, averaged over processes).
Metrics: ``dpo/loss``, ``rewards/chosen`` (``beta (logp - logp_ref)`` over the desirable rows),
``rewards/rejected`` (the undesirable rows), ``kto/kl`` (``z0``), ``dpo/grad_norm``, ``dpo/lr``.
At start a warning names weights outside the paper's advice (``lambda_D n_D / (lambda_U n_U)`` in
``[1, 4/3]`` over the training split).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from posttrain.algo.kto_loss import kto_reference_point, weight_balance_advice
from posttrain.data.handlers import IGNORE_INDEX
from posttrain.loops.offline import OfflineTrainer, labelled_batch
from posttrain.training.loss_fns import make_kto_loss_fn

log = logging.getLogger(__name__)


def mismatched_samples(samples: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(input_ids, labels)`` of row ``i``'s prompt followed by row ``i - 1``'s completion (cyclic)."""
    def split(ids, labels):
        start = int(np.flatnonzero(labels != IGNORE_INDEX)[0])
        return ids[:start], ids[start:], labels[start:]

    parts = [split(ids, labels) for ids, labels in samples]
    out = []
    for i, (prompt, _, _) in enumerate(parts):
        _, completion, completion_labels = parts[i - 1]
        out.append((np.concatenate([prompt, completion]),
                    np.concatenate([np.full(len(prompt), IGNORE_INDEX, dtype=completion_labels.dtype),
                                    completion_labels])))
    return out


class KTOTrainer(OfflineTrainer):
    batch_phase = "reference_model"  # building a batch runs the reference (and the policy, no gradients)

    def __init__(self, plan, session):
        super().__init__(plan, session)
        o = plan.dpo
        advice = weight_balance_advice(*session.dataset.label_counts(), o.desirable_weight, o.undesirable_weight)
        if advice:
            log.warning(advice)

    def loss_fn(self):
        o = self.plan.dpo
        return make_kto_loss_fn(beta=o.beta, desirable_weight=o.desirable_weight,
                                undesirable_weight=o.undesirable_weight)

    def batch(self) -> dict[str, torch.Tensor]:
        p, micro = self.s.policy, self.plan.policy.optim.micro_batch_size
        items = self.items()
        samples = [(it["input_ids"], it["labels"]) for it in items]
        matched = labelled_batch(samples, p.pad_token_id)
        mismatched = labelled_batch(mismatched_samples(samples), p.pad_token_id)
        pairs = {f"{side}_{k}": v for side, rows in (("chosen", matched), ("rejected", mismatched))
                 for k, v in rows.items()}
        ref_matched, ref_mismatched = p.reference.compute_pair_logps(pairs, micro_batch_size=micro)
        policy_mismatched = p.actor.compute_logprobs(mismatched, micro_batch_size=micro).sum(-1)
        z0 = kto_reference_point(policy_mismatched.float().cpu(), ref_mismatched.float().cpu())
        desirable = torch.tensor([int(it["desirable"][0]) for it in items], dtype=torch.float32)
        rows = len(items)
        return {**matched, "ref_logps": ref_matched.float().cpu(), "kto_desirable": desirable,
                "kto_reference_point": z0.expand(rows).clone(),
                "kto_num_desirable": desirable.sum().expand(rows).clone(),
                "kto_num_undesirable": (rows - desirable.sum()).expand(rows).clone()}

    def batch_metrics(self, batch):
        return {"kto/kl": float(batch["kto_reference_point"][0])}
