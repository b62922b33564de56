"""The on-policy experience: the TransferDock's schema, and the one path between its rows and the
training batch of :mod:`posttrain.training.batch`.

Each tensor has one name from rollout to loss: the dock column ``old_logprobs`` is the batch key
``old_logprobs`` that the actor loss reads. Per-token columns (``old_logprobs``, ``ref_logprobs``,
``advantages``, ``returns``, ``values``, ``rollout_logprobs``: the rollout engine's log-probs of the
sampled tokens, ``rollout_weights``: the rollout correction's) hold one value per response token;
``policy_version`` is the number of updates behind the weights that sampled the row (the oldest
segment's, for a sample continued over iterations). A multi-turn run adds
``response_mask`` (1 on sampled tokens, 0 on tool tokens): the training batch's ``response_mask``
is the product of it and the padding mask, so the loss never sees a tool token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.models.vlm import MM_KEYS, SampleImages
from posttrain.training.batch import build_batch, per_token, unpad
from posttrain.transfer_dock import TransferDock

COLUMNS = ("prompts", "prompt_length", "labels", "responses", "response_length", "scores",
           "old_logprobs", "ref_logprobs", "advantages", "returns", "values",
           "rollout_logprobs", "rollout_weights", "policy_version")
PER_TOKEN = ("old_logprobs", "ref_logprobs", "advantages", "returns", "values", "rollout_logprobs", "rollout_weights")
# multi-turn rollouts add these: ``response_mask`` (per token: 1 sampled, 0 tool) and ``tool_call_num``
MULTI_TURN_COLUMNS = ("response_mask", "tool_call_num")
# the phases that read the dock, in the order of one iteration
CONSUMERS = ("rollout", "reward", "advantages", "ref_logprobs", "old_logprobs", "rollout_correction",
             "critic_values", "critic_update", "actor_update", "metrics")


def new_dock(rows: int, n: int, *, guarantee_order: bool, seed: int, extra_columns: Sequence[str] = (),
             extra_consumers: Sequence[str] = (), queue=None) -> TransferDock:
    """An empty dock of ``rows`` rows: a TransferDock, or with ``queue`` (the session's
    :class:`~posttrain.cluster.transfer_queue.TransferQueueStore`, data_strategy: tq) one whose cells
    live in TransferQueue."""
    make = TransferDock if queue is None else queue.new_dock
    return make(rows, (*COLUMNS, *extra_columns), (*CONSUMERS, *extra_consumers), n_samples_per_prompt=n,
                guarantee_order=guarantee_order, seed=seed)


def read_batch(td: TransferDock, consumer: str, columns: Sequence[str], count: int | None, *, pad_token_id: int,
               device=None, indexes: Sequence[int] | None = None,
               vit_micro_batch_size: int | None = None) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    """``count`` rows (or the rows ``indexes``) for ``consumer`` as a training batch (the layout of
    :func:`build_batch` plus the per-token ``columns`` as ``[B, R]``), their dock indexes and their
    response lengths. A multimodal dock's rows bring their images (``images``: a
    :class:`~posttrain.models.vlm.SampleImages`, with ``vit_micro_batch_size`` images per tower forward)."""
    tool_mask = "response_mask" in td.columns  # multi-turn: 0 on tool tokens
    images = [c for c in (*MM_KEYS, "image_embeds") if c in td.columns]
    read = ["prompts", "responses", "response_length", *columns, *(["response_mask"] if tool_mask else []), *images]
    batch, idx = td.get(consumer, read, count, indexes=indexes)
    tensors = build_batch(batch["prompts"], batch["responses"], pad_token_id=pad_token_id)
    width = tensors["response_mask"].shape[1]
    if tool_mask:
        tensors["response_mask"] = tensors["response_mask"] * per_token(batch["response_mask"], width).long()
    for column in columns:
        tensors[column] = per_token(batch[column], width)
    if images:
        tensors["images"] = SampleImages([{c: batch[c][i] for c in images} for i in range(len(idx))],
                                         vit_micro_batch_size)
    if device is not None:
        tensors = {k: v.to(device) for k, v in tensors.items()}
    return tensors, idx, [int(x) for x in batch["response_length"]]


def write_rows(td: TransferDock, columns: Sequence[str], idx: list[int], matrices: Sequence[torch.Tensor],
               lengths: Sequence[int]) -> None:
    """Put per-token ``[B, R]`` results back, each row cut to its response length."""
    td.put(list(columns), idx, [unpad(m.float(), lengths) for m in matrices])


def per_group(batch: dict[str, list[torch.Tensor]]) -> tuple[list[int], torch.Tensor]:
    """(response lengths, a ``[B, R]`` mask of the response tokens) of whole groups of rows."""
    lengths = [int(x) for x in batch["response_length"]]
    return lengths, per_token([torch.ones(n) for n in lengths], max(max(lengths), 1))
