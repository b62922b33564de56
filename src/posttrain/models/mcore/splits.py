"""Megatron-Core's tensor-parallel layouts, as pure functions on tensors.

Each ``split_*`` takes full Hugging Face tensors and returns the ``tp`` shards that Megatron-Core's
ranks hold; each ``merge_*`` is its exact inverse. The layouts:

* ``linear_qkv`` (column parallel): the rows are grouped per query group, ``[q heads of the group;
  k; v]``, groups in order, and each rank holds ``num_query_groups / tp`` whole groups.
* ``linear_fc1`` of a gated MLP (column parallel): rank ``r`` holds ``[gate_r; up_r]``, where
  ``gate_r`` and ``up_r`` are the ``r``-th row blocks of gate and up.
* other column-parallel linears split their rows (dim 0), row-parallel ones (``linear_proj``,
  ``linear_fc2``, the reward head) their columns (dim 1).
* the word embedding and the output layer are vocab parallel: the vocabulary is padded with zero
  rows to :func:`padded_vocab_size`, then split in row blocks.

Norm weights are replicated on every rank.
"""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError


MAX_PADDING = 1 << 16  # zero rows of vocabulary padding beyond which a divisor is a mistake


def check_sizes(*, tp: int, pp: int, layers_per_virtual_stage: int | None, divisor: int) -> None:
    """Refuse a size below 1, naming its flag (before any arithmetic divides by it)."""
    for flag, value in (("--target-tensor-parallel-size", tp), ("--target-pipeline-parallel-size", pp),
                        ("--num-layers-per-virtual-pipeline-stage", layers_per_virtual_stage),
                        ("--make-vocab-size-divisible-by", divisor)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, found {value}")


def padded_vocab_size(vocab_size: int, divisor: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``divisor * tp`` (Megatron's padding)."""
    if divisor < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by must be a positive integer, found {divisor}")
    multiple = divisor * tp
    padded = -(-vocab_size // multiple) * multiple
    if padded - vocab_size > max(vocab_size, MAX_PADDING):
        raise ConfigError(f"--make-vocab-size-divisible-by {divisor} x TP {tp} pads the vocabulary of {vocab_size} "
                          f"tokens to {padded} rows ({padded - vocab_size} zero rows); use a divisor such as 128")
    return padded


def check_tp(tp: int, *, heads: int, groups: int, ffn: int, padded_vocab: int | None = None) -> None:
    """Refuse a TP size that does not divide what it splits, naming the number."""
    if tp < 1:
        raise ConfigError(f"--target-tensor-parallel-size must be a positive integer, found {tp}")
    for what, n in (("attention heads", heads), ("query groups (key/value heads)", groups),
                    ("FFN hidden size", ffn)):
        if n % tp:
            raise ConfigError(f"tensor parallel size {tp} does not divide the model's {n} {what}; "
                              f"choose a TP size that divides {n}")
    if padded_vocab is not None and padded_vocab % tp:
        raise ConfigError(f"the padded vocabulary ({padded_vocab}) is not a multiple of the TP size {tp}")


def split_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, tp: int) -> list[torch.Tensor]:
    """HF q/k/v (weights ``[rows, hidden]`` or biases ``[rows]``) -> the per-rank ``linear_qkv``."""
    per_group = [t.reshape(groups, t.shape[0] // groups, *t.shape[1:]) for t in (q, k, v)]
    fused = torch.cat(per_group, dim=1)  # [groups, (q_per_group + 2) * head_dim, ...]
    return [s.reshape(-1, *q.shape[1:]).clone() for s in fused.chunk(tp, dim=0)]


def merge_qkv(shards: list[torch.Tensor], heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """The per-rank ``linear_qkv`` -> HF (q, k, v)."""
    q_rows = heads // groups * head_dim
    fused = torch.cat(shards, dim=0).reshape(groups, q_rows + 2 * head_dim, *shards[0].shape[1:])
    q, k, v = fused.split([q_rows, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *shards[0].shape[1:]).contiguous() for t in (q, k, v))


def split_gated_fc1(gate: torch.Tensor, up: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]


def merge_gated_fc1(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    halves = [s.chunk(2, dim=0) for s in shards]
    return (torch.cat([g for g, _ in halves], dim=0).contiguous(),
            torch.cat([u for _, u in halves], dim=0).contiguous())


def split_dim(t: torch.Tensor, tp: int, dim: int) -> list[torch.Tensor]:
    """Column parallel (``dim=0``) or row parallel (``dim=1``)."""
    return [s.clone() for s in t.chunk(tp, dim=dim)]


def merge_dim(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(shards, dim=dim).contiguous()


def split_vocab(t: torch.Tensor, padded: int, tp: int) -> list[torch.Tensor]:
    """Pad the vocabulary rows with zeros to ``padded``, then split the rows."""
    if t.shape[0] > padded:
        raise ConfigError(f"the vocabulary ({t.shape[0]} rows) is larger than the padded size {padded}")
    full = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if padded > t.shape[0] else t
    return split_dim(full, tp, 0)


def merge_vocab(shards: list[torch.Tensor], vocab_size: int) -> torch.Tensor:
    return torch.cat(shards, dim=0)[:vocab_size].contiguous()
