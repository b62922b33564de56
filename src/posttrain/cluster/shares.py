"""How a call's rows are shared by a worker group: contiguous shares for the passes without a
collective, and each rank's slices of every optimizer step for a data-parallel update."""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError
from posttrain.train.engine import minibatch_order


def spans(count: int, parts: int, keep_empty: bool = False) -> list[tuple[int, int]]:
    """Contiguous, balanced ``(start, stop)`` shares of ``count`` rows; empty shares dropped
    unless ``keep_empty`` (FSDP2: every worker must take part in the parameter gather)."""
    bounds = [count * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if keep_empty or bounds[i + 1] > bounds[i]]


def update_shards(num_rows: int, mini_batch_size: int, world: int, epochs: int, shuffle: bool,
                  seed: int) -> list[torch.Tensor]:
    """Row indices for each rank: the optimizer steps of :meth:`TrainEngine.update` (same order,
    same shuffle), each cut into ``world`` equal slices; rank ``r`` gets slice ``r`` of every step."""
    if mini_batch_size % world:
        raise ConfigError(f"a mini-batch of {mini_batch_size} rows (rl_config.mini_batch_size x "
                          f"n_samples_per_prompt) cannot be shared equally by {world} data-parallel replicas "
                          f"(rl_config.actor_resource.num_npus); make it a multiple of the worker count.")
    local = mini_batch_size // world
    steps = minibatch_order(num_rows, mini_batch_size, epochs=epochs, shuffle=shuffle, seed=seed)
    return [torch.cat([step[rank * local:(rank + 1) * local] for step in steps]) for rank in range(world)]
