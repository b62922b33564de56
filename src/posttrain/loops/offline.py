"""The offline loop (SFT, and DPO in :mod:`posttrain.loops.dpo`): batches from a fixed dataset,
one optimizer step per global batch.

SFT samples come from ``AlpacaStyleInstructionHandler`` data: ``input_ids`` with ``labels`` that are
-100 (IGNORE) on the prompt tokens (with ``rl_config.is_multimodal``, and each sample's images:
:mod:`posttrain.loops.sft_images`). Each sample is split there into prompt and response, put in the
training layout of :mod:`posttrain.training.forward`, and trained with cross-entropy on the response
tokens, token-mean over the whole global batch. The run itself (data, policy, sampler, logs,
checkpoints) is the :class:`~posttrain.loops.session.Session` that every loop shares.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from posttrain.config.plan import Plan
from posttrain.data.handlers import IGNORE_INDEX
from posttrain.errors import DataError
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.metrics.timers import Timers
from posttrain.training.batch import build_batch, per_token
from posttrain.training.loss_fns import make_sft_loss_fn
from posttrain.loops.dump_points import dump_batch
from posttrain.loops.sft_images import image_samples
from posttrain.models.vlm import SampleImages
from posttrain.loops.session import Session, check_finite_step

log = logging.getLogger(__name__)


def split_sample(input_ids: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt, response, response mask) of one SFT sample: the response starts at the first label,
    and the mask is 0 on the tokens after it that have no label (the user or tool turns of a
    multi-turn conversation, the prompts of later samples in a packed row)."""
    valid = labels != IGNORE_INDEX
    if not valid.any():
        raise DataError("an SFT sample has no response tokens (every label is -100)")
    start = int(np.flatnonzero(valid)[0])
    return (torch.as_tensor(input_ids[:start], dtype=torch.long), torch.as_tensor(input_ids[start:], dtype=torch.long),
            torch.as_tensor(valid[start:], dtype=torch.long))


def labelled_batch(samples: list[tuple[np.ndarray, np.ndarray]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The training layout of ``(input_ids, labels)`` samples, trained on their labelled tokens."""
    parts = [split_sample(ids, labels) for ids, labels in samples]
    tensors = build_batch([p for p, _, _ in parts], [r for _, r, _ in parts], pad_token_id=pad_token_id)
    tensors["response_mask"] = tensors["response_mask"] * per_token([m for _, _, m in parts],
                                                                    tensors["response_mask"].shape[1]).long()
    return tensors


class OfflineTrainer:
    """Sampler -> batch -> one optimizer step per global batch, on the session's policy.

    Subclasses build a batch (``batch``) and a loss (``loss_fn``).
    """

    batch_phase = "data"  # the timing key of building a batch

    def __init__(self, plan: Plan, session: Session):
        self.plan, self.s = plan, session

    # ---- what subclasses define ------------------------------------------------------------------
    def batch(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def loss_fn(self):
        raise NotImplementedError

    def batch_metrics(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return {}

    # ---- the loop --------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        s, loss_fn, last = self.s, self.loss_fn(), {}
        try:
            for iteration in range(s.iteration + 1, self.plan.train_iters + 1):
                timers, acc = Timers(around=s.phase), MetricAccumulator()
                with s.profiler.step(iteration), s.dumps.step(iteration), timers("all"):
                    with timers(self.batch_phase):
                        batch = self.batch()
                    dump_batch(s.dumps, batch)  # msprobe_config.key_data_dump
                    with timers("update"):
                        steps = s.policy.actor.update(batch, loss_fn, mini_batch_size=self.plan.prompts_per_iteration)
                    for step in steps:
                        check_finite_step(step, iteration)
                        s.dumps.record_scalars("key_data", step)
                        acc.update(step)
                last = {**acc.reduce(), **timers.metrics(), **self.batch_metrics(batch)}
                s.after_iteration(iteration, last)
            s.finish()
        finally:
            s.close()
        return last

    def items(self) -> list[dict]:
        return [self.s.dataset[i] for i in self.s.sampler.next_batch()]


class SFTTrainer(OfflineTrainer):
    """Cross-entropy on the response tokens of ``AlpacaStyleInstructionHandler`` data; with
    ``rl_config.is_multimodal`` each sample's images too (:mod:`posttrain.loops.sft_images`)."""

    def batch(self) -> dict[str, torch.Tensor]:
        items, policy, mm = self.items(), self.s.policy, self.plan.multimodal
        if mm is None:
            tensors = labelled_batch([(it["input_ids"], it["labels"]) for it in items], policy.pad_token_id)
        else:
            samples, images = image_samples(items, policy.processor, int(policy.image_token_id),  # Ray: no model here
                                            str(self.plan.data.data_path))
            tensors = labelled_batch(samples, policy.pad_token_id)
            tensors["images"] = SampleImages(images, mm.vit_micro_batch_size)
        return {k: v.to(self.s.device) for k, v in tensors.items()}

    def loss_fn(self):
        return make_sft_loss_fn()

    def batch_metrics(self, batch):
        return {"sft/tokens": float(batch["attention_mask"].sum())}
