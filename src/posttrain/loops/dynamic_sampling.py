"""DAPO dynamic sampling (seed 2.3, ``filter_groups_enable``; Yu et al. 2025, "DAPO").

A group of ``n`` responses whose scores all agree carries no GRPO signal (its advantages are 0).
Dynamic sampling generates batches of ``global_batch_size`` prompts into a *sampling*
TransferDock, scores them, keeps the groups whose ``filter_groups_metric`` scores vary
(``np.std(scores) > 0``, or every group when ``n == 1``), and copies them into the *main*
TransferDock of ``filter_groups_train_batch_size`` prompts that the rest of the iteration
(advantages, log-probs, update) reads. It repeats until the main dock is full; extra kept groups
of the last batch are dropped (the seed truncates too). After ``filter_groups_max_batches``
generation batches without filling it (``<= 0``: no cap) it raises the seed's error
"Generated too many. Please check your data.".

Metrics: ``train/num_gen_batches``, ``dapo/num_kept_groups`` (groups kept over all batches), and
the throughputs of the seed (e2e/vllm over ``gbs x num_gen_batches`` prompts, update over
``filter_groups_train_batch_size``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from posttrain.errors import DataError
from posttrain.loops.experience import new_dock
from posttrain.transfer_dock import TransferDock

log = logging.getLogger(__name__)

# the rows copied from the sampling dock into the main dock
CARRIED = ("prompts", "prompt_length", "labels", "responses", "response_length", "scores", "rollout_logprobs",
           "policy_version")
CONSUMER = "dynamic_sampling"
# rollout seed of extra generation batches: iteration + k * stride. Each batch keys its prompts
# 0..gbs-1 (their dock groups), so the distinct seeds keep the batches' streams distinct.
SEED_STRIDE = 100_003


def metric_column(metric: str) -> str:
    """The sampling-dock column that holds one verifier's per-sample scores."""
    return f"score/{metric}"


def keep_groups(scores: np.ndarray, n: int) -> np.ndarray:
    """Indexes of the groups (rows ``g*n .. g*n+n-1``) whose scores vary (``std > 0``); all if ``n == 1``."""
    groups = np.asarray(scores, dtype=np.float64).reshape(-1, n)
    if n == 1:
        return np.arange(groups.shape[0])
    return np.flatnonzero(groups.std(axis=1) > 0)


class DynamicSampler:
    """Fills the main TransferDock with groups of varying scores (see the module docstring)."""

    def __init__(self, options, *, n: int, global_batch_size: int, train_prompts: int, seed: int,
                 guarantee_order: bool = False, carry: tuple[str, ...] = (), queue=None):
        self.carry = (*CARRIED, *carry)  # the columns a kept group brings along (plus multi-turn's)
        self.n = n
        self.gbs = global_batch_size
        self.train_prompts = train_prompts  # filter_groups_train_batch_size
        self.max_batches = options.max_batches
        self.metric = options.metric
        self.guarantee_order = guarantee_order
        self.seed = seed
        self.queue = queue  # data_strategy: tq: the sampling docks live in TransferQueue too
        self.num_gen_batches = 0
        self.num_kept = 0

    @property
    def train_rows(self) -> int:
        return self.train_prompts * self.n

    def fill(self, generate_and_score, td: TransferDock, timers, acc, iteration: int) -> None:
        """Generate, score and filter until ``td`` (the main dock) holds ``train_prompts`` groups.
        ``generate_and_score(dock, iteration, timers, acc)`` fills a sampling dock with prompts,
        their responses (seeded by ``iteration``) and their scores."""
        self.num_gen_batches, self.num_kept = 0, 0
        filled = 0
        while filled < self.train_prompts:
            if self.max_batches > 0 and self.num_gen_batches >= self.max_batches:
                raise DataError(
                    f"Generated too many. Please check your data. ({self.num_gen_batches} generation batch(es) "
                    f"of {self.gbs} prompts gave {filled} of filter_groups_train_batch_size={self.train_prompts} "
                    f"prompts whose '{self.metric}' scores vary; raise rl_config.filter_groups_max_batches "
                    f"(<= 0: no cap) or use prompts that the model sometimes solves)")
            self.num_gen_batches += 1
            sample = new_dock(self.gbs * self.n, self.n, guarantee_order=self.guarantee_order,
                              seed=self.seed + iteration * 7919 + self.num_gen_batches,
                              extra_columns=[metric_column(self.metric), *self.carry[len(CARRIED):]],
                              extra_consumers=[CONSUMER], queue=self.queue)
            generate_and_score(sample, iteration + SEED_STRIDE * (self.num_gen_batches - 1), timers, acc)
            with timers("dynamic_sampling"):
                filled = self._move(sample, td, filled)
        acc.update({"dapo/num_kept_groups": float(self.num_kept)})

    def _move(self, sample: TransferDock, td: TransferDock, filled: int) -> int:
        """Copy the kept groups of ``sample`` into ``td`` from group ``filled`` on; returns the new count."""
        rows = list(range(sample.max_len))
        batch, _ = sample.get(CONSUMER, [*self.carry, metric_column(self.metric)], indexes=rows)
        scores = np.array([float(x.reshape(-1)[0]) for x in batch[metric_column(self.metric)]])
        kept = keep_groups(scores, self.n)
        self.num_kept += len(kept)
        take = kept[: self.train_prompts - filled]
        log.info("dynamic sampling: batch %d kept %d of %d groups (%d/%d filled)", self.num_gen_batches,
                 len(kept), len(scores) // self.n, filled + len(take), self.train_prompts)
        if len(take) == 0:
            return filled
        src = [g * self.n + k for g in take for k in range(self.n)]
        dst = list(range(filled * self.n, (filled + len(take)) * self.n))
        td.put(list(self.carry), dst, [[batch[c][i] for i in src] for c in self.carry])
        return filled + len(take)

    def metrics(self) -> dict[str, float]:
        return {"train/num_gen_batches": float(self.num_gen_batches)}


def score_columns(td: TransferDock, per_verifier: dict[str, list[float]]) -> tuple[list[str], list[torch.Tensor]]:
    """The ``score/<verifier>`` columns ``td`` has, and their per-sample values (for ``put``)."""
    names = [name for name in per_verifier if metric_column(name) in td.columns]
    return [metric_column(n) for n in names], [torch.tensor(per_verifier[n], dtype=torch.float32) for n in names]
