"""How a call's rows are shared by a worker group: contiguous shares (or, with
``rl_config.use_dp_batch_balance``, shares of the same sizes balanced by tokens) for the passes
without a collective, put back in row order, and each rank's slices of every optimizer step for a
data-parallel update."""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError
from posttrain.training.dynamic_batch import balanced_shares
from posttrain.training.engine import minibatch_order


def spans(count: int, parts: int, keep_empty: bool = False) -> list[tuple[int, int]]:
    """Contiguous, balanced ``(start, stop)`` shares of ``count`` rows; empty shares dropped
    unless ``keep_empty`` (FSDP2: every worker must take part in the parameter gather)."""
    bounds = [count * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if keep_empty or bounds[i + 1] > bounds[i]]


def token_lengths(batch: dict) -> list[int] | None:
    """Each row's tokens (prompt + response: the sum of its ``*attention_mask`` columns, a DPO
    pair's two sides together), or None when the batch has no attention mask."""
    masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
    return sum(m.sum(-1) for m in masks).tolist() if masks else None


def shares(count: int, parts: int, lengths: list[int] | None = None, keep_empty: bool = False) -> list[torch.Tensor]:
    """Row indices of each of ``parts`` shares of ``count`` rows: the contiguous :func:`spans`, or with
    ``lengths`` (``rl_config.use_dp_batch_balance``) shares of the same sizes balanced by tokens
    (:func:`~posttrain.training.dynamic_batch.balanced_shares`)."""
    cuts = spans(count, parts, keep_empty)
    if lengths is None:
        return [torch.arange(lo, hi) for lo, hi in cuts]
    return [torch.tensor(rows, dtype=torch.long) for rows in balanced_shares(lengths, [hi - lo for lo, hi in cuts])]


def in_order(parts: list[torch.Tensor], rows: list[torch.Tensor]) -> torch.Tensor:
    """The shares' results (row ``i`` of ``parts[s]`` is row ``rows[s][i]``) back in the original row order."""
    return torch.cat(parts)[torch.cat(rows).argsort()]


def update_shards(num_rows: int, mini_batch_size: int, world: int, epochs: int, shuffle: bool,
                  seed: int, lengths: list[int] | None = None) -> list[torch.Tensor]:
    """Row indices for each rank: the optimizer steps of :meth:`TrainEngine.update` (same order,
    same shuffle), each cut into ``world`` equal slices; rank ``r`` gets slice ``r`` of every step.
    With ``lengths`` (``rl_config.use_dp_batch_balance``) each step's slices hold the same number of
    rows, balanced by tokens; the loss is normalised over the whole step, so the step is the same."""
    if mini_batch_size % world:
        raise ConfigError(f"a mini-batch of {mini_batch_size} rows (rl_config.mini_batch_size x "
                          f"n_samples_per_prompt) cannot be shared equally by {world} data-parallel replicas "
                          f"(rl_config.actor_resource.num_npus); make it a multiple of the worker count.")
    local = mini_batch_size // world
    steps = minibatch_order(num_rows, mini_batch_size, epochs=epochs, shuffle=shuffle, seed=seed)
    if lengths is None:
        slices = [[step[rank * local:(rank + 1) * local] for rank in range(world)] for step in steps]
    else:
        slices = [[step[torch.tensor(rows, dtype=torch.long)] for rows in
                   balanced_shares([lengths[i] for i in step.tolist()], [local] * world)] for step in steps]
    return [torch.cat([step_slices[rank] for step_slices in slices]) for rank in range(world)]
