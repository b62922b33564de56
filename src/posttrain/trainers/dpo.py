"""The offline DPO loop (seed 2.5): preference pairs, a frozen reference, one step per global batch.

Data: a pairwise dataset preprocessed with ``AlpacaStylePairwiseHandler`` (``chosen_input_ids``,
``chosen_labels``, ``rejected_input_ids``, ``rejected_labels``; labels are -100 on the prompt).
Each pair is split at its first label into prompt and answer and put in the training layout of
:mod:`posttrain.train.forward` twice (``chosen_*`` and ``rejected_*``).

Per global batch of ``global_batch_size`` pairs:

1. the reference's sequence log-probs ``ref_c``, ``ref_r`` (sum over answer tokens; mean for
   ``ipo``), without gradients;
2. one optimizer step on :func:`posttrain.algo.dpo_loss.dpo_loss` (``dpo_loss_type`` sigmoid,
   hinge, ipo or kto_pair; ``dpo_beta``; ``dpo_label_smoothing``; ``pref_ftx`` adds the chosen
   answer's token-mean NLL), averaged over the pairs of the batch, in micro-batches of
   ``micro_batch_size`` pairs.

The reference is ``ref_model`` when set (an HF directory or checkpoint), else a frozen copy of the
initial policy. Metrics: ``dpo/loss``, ``rewards/chosen``, ``rewards/rejected``
(``beta (logp_policy - logp_ref)``), ``rewards/accuracies``, ``rewards/margins``,
``dpo/grad_norm``, ``dpo/lr``, ``timing/all``.
"""

from __future__ import annotations

import logging

import torch

from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError
from posttrain.trainers import setup
from posttrain.trainers.experience import sequence_batch
from posttrain.trainers.offline import OfflineTrainer, split_sample

log = logging.getLogger(__name__)
SIDES = ("chosen", "rejected")


def check_dpo_config(cfg: RunConfig) -> None:
    """DPO's own rules (the loss type is checked with the seed's message by ``validate_run_config``)."""
    a = cfg.actor
    from posttrain.algo.dpo_loss import dpo_loss_types

    if a.dpo_loss_type not in dpo_loss_types():
        raise ConfigError(f"Unknown loss type: {a.dpo_loss_type}. Should be one of {dpo_loss_types()}")
    if not a.is_pairwise_dataset:
        raise ConfigError("stage dpo trains on preference pairs: set megatron_training.is_pairwise_dataset: true "
                          "and preprocess the data with handler_name: AlpacaStylePairwiseHandler")
    if a.dpo_beta <= 0:
        raise ConfigError(f"megatron_training.dpo_beta must be > 0 (the seed's default is 0.1); got {a.dpo_beta}")
    if not 0.0 <= a.dpo_label_smoothing < 0.5:
        raise ConfigError(f"megatron_training.dpo_label_smoothing must be in [0, 0.5) (the probability that a "
                          f"preference label is flipped); got {a.dpo_label_smoothing}")
    if a.pref_ftx < 0:
        raise ConfigError(f"megatron_training.pref_ftx must be >= 0 (weight of the SFT term); got {a.pref_ftx}")


def pair_batch(items: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``chosen_*`` and ``rejected_*`` training layouts of a list of pairwise samples."""
    out = {}
    for side in SIDES:
        pairs = [split_sample(it[f"{side}_input_ids"], it[f"{side}_labels"]) for it in items]
        tensors = sequence_batch([p for p, _ in pairs], [r for _, r in pairs], pad_token_id)
        out.update({f"{side}_{k}": v for k, v in tensors.items()})
    return out


@torch.no_grad()
def reference_logps(ref_model, batch: dict[str, torch.Tensor], *, average: bool, micro_batch_size: int,
                    device) -> dict[str, torch.Tensor]:
    """``ref_chosen_logps [N]`` and ``ref_rejected_logps [N]`` under the frozen reference."""
    from posttrain.train.loss_fns import MODEL_KEYS, sequence_logps

    out = {}
    rows = batch["chosen_input_ids"].shape[0]
    for side in SIDES:
        parts = []
        for start in range(0, rows, micro_batch_size):
            mb = {k: batch[f"{side}_{k}"][start:start + micro_batch_size].to(device)
                  for k in MODEL_KEYS if f"{side}_{k}" in batch}
            parts.append(sequence_logps(ref_model, mb, average=average)[0].float().cpu())
        out[f"ref_{side}_logps"] = torch.cat(parts)
    return out


def with_loss_metric(loss_fn):
    """Report the loss itself as ``dpo/loss`` (each micro-batch's share of the batch mean)."""

    def wrapped(model, micro_batch, *, num_tokens=None, num_seqs=None):
        loss, metrics = loss_fn(model, micro_batch, num_tokens=num_tokens, num_seqs=num_seqs)
        return loss, {"dpo/loss": loss.detach(), **metrics}

    return wrapped


class DPOTrainer(OfflineTrainer):
    metric_prefix = "dpo"
    dataset_kind = "pairwise dataset (AlpacaStylePairwiseHandler)"
    batch_phase = "reference_model"  # building a batch runs the reference

    def make_dataset(self, actor):
        from posttrain.data.datasets import PairwiseDataset

        return PairwiseDataset(actor.data_path, seq_length=actor.seq_length, split=actor.split)

    def prepare(self) -> None:
        self.engine.loss_mask_key = "chosen_response_mask"
        a = self.cfg.actor
        ref_path = a.ref_model or (self.initial_model if self.iteration > 0 else None)
        self.reference = setup.build_frozen_copy(self.model, ref_path, self.device)

    def loss_fn(self):
        from posttrain.train.loss_fns import make_dpo_loss_fn

        a = self.cfg.actor
        return with_loss_metric(make_dpo_loss_fn(beta=a.dpo_beta, loss_type=a.dpo_loss_type,
                                                 label_smoothing=a.dpo_label_smoothing, pref_ftx=a.pref_ftx))

    def batch(self) -> dict[str, torch.Tensor]:
        a = self.cfg.actor
        items = [self.dataset[i] for i in self.sampler.next_batch()]
        batch = pair_batch(items, self.tokenizer.pad_token_id)
        batch.update(reference_logps(self.reference, batch, average=a.dpo_loss_type == "ipo",
                                     micro_batch_size=a.micro_batch_size, device=self.device))
        return batch
