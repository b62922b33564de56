"""Data-parallel helpers for the training engine (torch.distributed; no-ops in one process).

With ``W`` data-parallel ranks each holding a slice of the mini-batch, the engine needs:

* **global counts**: ``num_tokens`` and ``num_seqs`` summed over ranks, so every rank normalises
  its micro-batch losses by the whole mini-batch;
* **loss scale ``W``**: DDP and FSDP average gradients over ranks, so each rank's loss
  ``sum_rank / N_global`` is multiplied by ``W`` to make the averaged gradient the gradient of the
  global token mean;
* **metric sum**: the metric shares (normalised by global counts) are summed over ranks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def dp_world_size(group=None) -> int:
    """Number of ranks in ``group`` (1 when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM over ranks (no-op in one process); returns ``tensor``."""
    if dp_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def global_counts(num_tokens, num_seqs: int, device, group=None):
    """``(num_tokens, num_seqs)`` summed over ranks, as float32 tensors (``num_tokens`` may be None)."""
    tokens = torch.zeros((), device=device) if num_tokens is None else num_tokens.to(device, torch.float32)
    counts = all_reduce_sum(torch.stack([tokens, torch.tensor(float(num_seqs), device=device)]), group)
    return (None if num_tokens is None else counts[0]), counts[1]


def reduce_metric_totals(totals: dict[str, torch.Tensor], group=None) -> dict[str, float]:
    """Sum the per-rank metric shares over ranks (one collective for all keys)."""
    if not totals:
        return {}
    keys = sorted(totals)
    stacked = all_reduce_sum(torch.stack([totals[key].reshape(()) for key in keys]), group)
    return {key: float(value) for key, value in zip(keys, stacked.tolist())}


def maybe_no_sync(model: torch.nn.Module, skip_sync: bool):
    """DDP's ``no_sync()`` for all but the last micro-batch of a step; a no-op otherwise."""
    if skip_sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
