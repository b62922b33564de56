"""The training batch layout, and the one function that builds it from token-id rows.

Batch layout (one dict of tensors, first dimension ``B`` rows):

* ``input_ids [B, P + R]`` (int64): the prompt **left**-padded to ``P`` columns, followed by the
  response **right**-padded to ``R`` columns. Every response therefore starts at column ``P``.
* ``attention_mask [B, P + R]``: 1 on real (prompt or response) tokens, 0 on padding.
* ``position_ids [B, P + R]``: ``cumsum(attention_mask) - 1`` clamped at 0, so the first real
  token of every row is at position 0 whatever its left padding.
* ``response_mask [B, R]``: 1 on the response tokens that count in the loss.

Per-token columns of the experience (log-probs, advantages, values...) are ``[B, R]``, aligned with
``response_mask``: :func:`per_token` pads rows to that width and :func:`unpad` cuts them back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """``cumsum(attention_mask) - 1`` clamped at 0: positions count real tokens only."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_width(batch: dict[str, torch.Tensor]) -> int:
    """``R``, the number of response columns (from ``response_mask``)."""
    return batch["response_mask"].shape[1]


def _rows(rows: Sequence) -> list[torch.Tensor]:
    return [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in rows]


def build_batch(prompts: Sequence, responses: Sequence, *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """The layout above from token-id rows (lists or 1-D tensors): ``input_ids``,
    ``attention_mask``, ``position_ids``, ``response_mask`` (CPU tensors; at least one response
    column, masked when every response is empty)."""
    prompts, responses = _rows(prompts), _rows(responses)
    if len(prompts) != len(responses):
        raise ValueError(f"one response per prompt row: {len(prompts)} prompts, {len(responses)} responses")
    num_prompt = max((p.numel() for p in prompts), default=0)
    num_resp = max(1, max((r.numel() for r in responses), default=0))
    input_ids = torch.full((len(prompts), num_prompt + num_resp), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, (prompt, response) in enumerate(zip(prompts, responses)):
        input_ids[b, num_prompt - prompt.numel():num_prompt] = prompt
        input_ids[b, num_prompt:num_prompt + response.numel()] = response
        attention_mask[b, num_prompt - prompt.numel():num_prompt + response.numel()] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": default_position_ids(attention_mask),
            "response_mask": attention_mask[:, num_prompt:].clone()}


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
