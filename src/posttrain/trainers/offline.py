"""The offline loop (SFT, and DPO in :mod:`posttrain.trainers.dpo`): batches from a fixed dataset,
one optimizer step per global batch.

SFT samples come from ``AlpacaStyleInstructionHandler`` data: ``input_ids`` with ``labels`` that are
-100 (IGNORE) on the prompt tokens. Each sample is split there into prompt and response, put in the
training layout of :mod:`posttrain.train.forward`, and trained with cross-entropy on the response
tokens, token-mean over the whole global batch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from posttrain.config.run import RunConfig
from posttrain.config.validate import Layout
from posttrain.device import resolve_device
from posttrain.errors import DataError
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.timers import Timers
from posttrain.train.dynamic_batch import apply_rl_config
from posttrain.trainers import setup
from posttrain.trainers.experience import sequence_batch

log = logging.getLogger(__name__)
IGNORE_INDEX = -100


def split_sample(input_ids: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, response) of one unpacked SFT sample: the response starts at the first label."""
    valid = np.flatnonzero(labels != IGNORE_INDEX)
    if valid.size == 0:
        raise DataError("an SFT sample has no response tokens (every label is -100)")
    start = int(valid[0])
    if not np.all(labels[start:] != IGNORE_INDEX):
        raise DataError("packed SFT samples (several prompts per row) are not supported by the SFT trainer; "
                        "preprocess with pack: false")
    return torch.as_tensor(input_ids[:start], dtype=torch.long), torch.as_tensor(input_ids[start:], dtype=torch.long)


class OfflineTrainer:
    """Dataset -> sampler -> batch -> one optimizer step per global batch, with resume and logs.

    Subclasses name their dataset (``dataset_kind``, ``make_dataset``), build a batch (``batch``)
    and a loss (``loss_fn``), and may prepare more after the weights are loaded (``prepare``).
    """

    metric_prefix = "sft"
    dataset_kind = "SFT dataset"
    batch_phase = "data"  # the timing key of building a batch

    def __init__(self, cfg: RunConfig, layout: Layout, run_dir: Path):
        from posttrain.metrics.sinks import MetricsLogger

        a = cfg.actor
        self.cfg, self.run_dir = cfg, run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        setup.seed_everything(a.seed)
        self.device = resolve_device(cfg.rl.device)
        dtype, _ = setup.precision(cfg, self.device)
        if not a.data_path:
            raise DataError(f"megatron_training.data_path is not set: give the prefix of a preprocessed "
                            f"{self.dataset_kind}")
        self.dataset = self.make_dataset(a)
        if len(self.dataset) == 0:
            raise DataError(f"the {self.dataset_kind} {a.data_path} is empty")
        self.model, self.tokenizer, source = setup.build_actor_model(cfg, self.device)
        self.engine = setup.build_train_engine(self.model, a, a.train_iters, dtype, metric_prefix=self.metric_prefix)
        apply_rl_config(self.engine, cfg.rl, "actor")  # use_remove_padding, use_dynamic_bsz budgets
        state = setup.resume(source, self.model, self.engine, a)
        self.iteration, self.initial_model = int(state["iteration"]), str(state["initial_model"])
        self.prepare()
        self.sampler = setup.build_sampler(len(self.dataset), a, state.get("sampler_state"))
        self.logger = MetricsLogger(run_dir, cfg.rl.use_tensorboard, cfg.rl.tensorboard_log_dir,
                                    total_iters=a.train_iters, start_iteration=self.iteration)
        (run_dir / "config.json").write_text(json.dumps(cfg.raw, indent=2, default=str))

    # ---- what subclasses define ------------------------------------------------------------------
    def make_dataset(self, actor):
        raise NotImplementedError

    def prepare(self) -> None:
        """Called once the actor's weights are loaded (DPO builds its reference here)."""

    def batch(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def loss_fn(self):
        raise NotImplementedError

    def batch_metrics(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return {}

    # ---- the loop --------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        a, loss_fn, last = self.cfg.actor, self.loss_fn(), {}
        try:
            for iteration in range(self.iteration + 1, a.train_iters + 1):
                timers, acc = Timers(), MetricAccumulator()
                with timers("all"):
                    with timers(self.batch_phase):
                        batch = self.batch()
                    with timers("update"):
                        steps = self.engine.update(batch, loss_fn, mini_batch_size=a.global_batch_size)
                for step in steps:
                    acc.update(step)
                last = {**acc.reduce(), **timers.metrics(), **self.batch_metrics(batch)}
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


class SFTTrainer(OfflineTrainer):
    """Cross-entropy on the response tokens of ``AlpacaStyleInstructionHandler`` data."""

    def make_dataset(self, actor):
        from posttrain.data.datasets import SFTDataset

        return SFTDataset(actor.data_path, seq_length=actor.seq_length, split=actor.split)

    def batch(self) -> dict[str, torch.Tensor]:
        pairs = [split_sample(it["input_ids"], it["labels"]) for it in
                 (self.dataset[i] for i in self.sampler.next_batch())]
        tensors = sequence_batch([p for p, _ in pairs], [r for _, r in pairs], self.tokenizer.pad_token_id)
        return {k: v.to(self.device) for k, v in tensors.items()}

    def loss_fn(self):
        from posttrain.train.loss_fns import make_sft_loss_fn

        return make_sft_loss_fn()

    def batch_metrics(self, batch):
        return {"sft/tokens": float(batch["attention_mask"].sum())}
