"""Turning TransferDock rows into the training batch layout of :mod:`posttrain.train.forward`.

Prompts are left-padded to ``P`` columns and responses right-padded to ``R`` columns, so every
response starts at column ``P``; per-token columns (logprobs, advantages...) are ``[B, R]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.transfer_dock import pad_rows


def left_pad(rows: Sequence[torch.Tensor], pad_value: int) -> torch.Tensor:
    width = max(int(r.numel()) for r in rows)
    out = torch.full((len(rows), width), pad_value, dtype=torch.long)
    for i, row in enumerate(rows):
        if row.numel():
            out[i, width - row.numel():] = row
    return out


def sequence_batch(prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                   pad_token_id: int) -> dict[str, torch.Tensor]:
    """``input_ids [B, P+R]``, ``attention_mask``, ``response_mask [B, R]`` from token-id rows."""
    left = left_pad(prompts, pad_token_id)
    right = pad_rows([r.long() for r in responses], pad_token_id).long()
    if right.shape[1] == 0:  # every response empty: keep one (masked) column
        right = torch.full((len(responses), 1), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(left)
    for i, row in enumerate(prompts):
        if row.numel():
            prompt_mask[i, left.shape[1] - row.numel():] = 1
    response_mask = torch.zeros_like(right)
    for i, row in enumerate(responses):
        response_mask[i, : row.numel()] = 1
    return {
        "input_ids": torch.cat([left, right], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "response_mask": response_mask,
    }


def per_token(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Right-pad float rows to ``[B, width]`` (for logprobs, advantages, values...)."""
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        k = min(int(row.numel()), width)
        out[i, :k] = row[:k].float()
    return out


def unpad(matrix: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Rows of ``[B, R]`` cut to their lengths (for putting back into the TransferDock)."""
    return [matrix[i, : int(n)].detach().cpu() for i, n in enumerate(lengths)]
