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

import json
import logging
from pathlib import Path

import torch

from posttrain.config.run import RunConfig
from posttrain.config.validate import Layout
from posttrain.device import resolve_device
from posttrain.errors import ConfigError, DataError
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.timers import Timers
from posttrain.trainers import setup
from posttrain.trainers.experience import sequence_batch
from posttrain.trainers.offline import split_sample

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


class DPOTrainer:
    def __init__(self, cfg: RunConfig, layout: Layout, run_dir: Path):
        from posttrain.checkpoint import load_checkpoint, resolve_checkpoint
        from posttrain.data.datasets import PairwiseDataset
        from posttrain.data.sampler import ResumableSampler
        from posttrain.metrics.sinks import MetricsLogger

        a = cfg.actor
        self.cfg, self.run_dir = cfg, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        setup.seed_everything(a.seed)
        self.device = resolve_device(cfg.rl.device)
        dtype, _ = setup.precision(cfg, self.device)
        if not a.data_path:
            raise DataError("megatron_training.data_path is not set: give the prefix of a pairwise dataset "
                            "(preprocessed with AlpacaStylePairwiseHandler)")
        self.dataset = PairwiseDataset(a.data_path, seq_length=a.seq_length, split=a.split)
        if len(self.dataset) == 0:
            raise DataError(f"the pairwise dataset {a.data_path} is empty")
        self.model, self.tokenizer, source = setup.build_actor_model(cfg, self.device)
        self.engine = setup.build_train_engine(self.model, a, a.train_iters, dtype, metric_prefix="dpo")
        self.engine.loss_mask_key = "chosen_response_mask"
        self.iteration, sampler_state, initial = 0, None, source
        _, full = resolve_checkpoint(source)
        if full and not a.finetune:
            state = load_checkpoint(source, self.model, self.engine.optimizer, self.engine.scheduler,
                                    no_load_optim=bool(a.no_load_optim), no_load_rng=bool(a.no_load_rng))
            self.iteration, sampler_state = int(state["iteration"]), state.get("sampler_state")
            initial = state.get("initial_model", source)
        self.initial_model = str(initial)
        ref_path = a.ref_model or (self.initial_model if self.iteration > 0 else None)
        self.reference = setup.build_frozen_copy(self.model, ref_path, self.device)
        self.sampler = ResumableSampler.from_seed_flags(
            len(self.dataset), a.global_batch_size, a.seed, no_shuffle=a.no_shuffle,
            full_shuffle_instruction_dataset=a.full_shuffle_instruction_dataset,
            total_samples=a.train_iters * a.global_batch_size)
        if sampler_state is not None:
            self.sampler.load_state_dict(sampler_state)
        self.logger = MetricsLogger(run_dir, cfg.rl.use_tensorboard, cfg.rl.tensorboard_log_dir,
                                    total_iters=a.train_iters, start_iteration=self.iteration)
        (run_dir / "config.json").write_text(json.dumps(cfg.raw, indent=2, default=str))

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

    def fit(self) -> dict[str, float]:
        a, loss_fn, last = self.cfg.actor, self.loss_fn(), {}
        try:
            for iteration in range(self.iteration + 1, a.train_iters + 1):
                timers, acc = Timers(), MetricAccumulator()
                with timers("all"):
                    with timers("reference_model"):
                        batch = self.batch()
                    with timers("update"):
                        steps = self.engine.update(batch, loss_fn, mini_batch_size=a.global_batch_size)
                for step in steps:
                    acc.update(step)
                last = {**acc.reduce(), **timers.metrics()}
                self.iteration = iteration
                self.logger.log(iteration, last)
                if a.save and a.save_interval and iteration % a.save_interval == 0:
                    self.save(iteration)
            if a.save and self.iteration > 0:
                self.save(self.iteration)
        finally:
            self.logger.close()
        return last

    def save(self, iteration: int):
        from posttrain.checkpoint import save_checkpoint

        a = self.cfg.actor
        return save_checkpoint(a.save, iteration, self.model, self.engine.optimizer, self.engine.scheduler,
                               tokenizer=self.tokenizer, sampler_state=self.sampler.state_dict(),
                               trainer_state={"iteration": iteration, "initial_model": self.initial_model,
                                              "consumed_samples": iteration * a.global_batch_size},
                               save_optim=not a.no_save_optim, save_rng=not a.no_save_rng)
