"""The Megatron-Core backend's passes (issue 17, in progress), through Megatron's pipeline schedule
on vocab-parallel logits: next-token log-probs and entropy of a batch, and one optimizer step with
an algorithm's loss. Not yet behind the trainer's ``TrainEngine`` interface.
"""

from __future__ import annotations

from functools import partial

import torch

from posttrain.train.megatron.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs


def forward_logprobs(chunks: list, input_ids: torch.Tensor, *, vocab_size: int, temperature: float = 1.0,
                     with_entropy: bool = False) -> dict[str, torch.Tensor] | None:
    """Log-probs ``[B, T - 1]`` of tokens ``1..T-1`` of ``input_ids`` ``[B, T]`` given the tokens
    before them (and their entropy), one sequence per micro-batch through
    ``get_forward_backward_func`` (forward only). Returned on the last pipeline stage; None on the
    others."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = input_ids.shape
    position_ids = torch.arange(seq).unsqueeze(0)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    outputs: dict[int, dict[str, torch.Tensor]] = {}

    def collect(row: int, logits: torch.Tensor):
        logits = logits[:, :-1]  # position t predicts token t + 1
        out = {"logprobs": vocab_parallel_logprobs(logits, input_ids[row:row + 1, 1:], vocab_size=vocab_size,
                                                   temperature=temperature)}
        if with_entropy:
            out["entropy"] = vocab_parallel_entropy(logits, vocab_size=vocab_size, temperature=temperature)
        outputs[row] = out
        return logits.new_zeros(()), {}

    def forward_step(rows, model):
        row = next(rows)
        return model(input_ids[row:row + 1], position_ids, causal), partial(collect, row)

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(batch)), model=chunks,
                                    num_microbatches=batch, seq_length=seq, micro_batch_size=1, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    return {key: torch.cat([outputs[r][key] for r in range(batch)]) for key in outputs[0]}


def _row_inputs(batch: dict[str, torch.Tensor], row: int):
    """Token ids, positions and the attention mask (True: masked; causal and padding) of one row of
    the training layout (left-padded prompt || right-padded response, posttrain.train.layout)."""
    from posttrain.train.layout import default_position_ids

    attention = batch["attention_mask"][row:row + 1]
    width = attention.shape[1]
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)
    mask = causal | ~attention.bool()[:, None, :]  # [1, T, T]: a query never sees a padded key
    return batch["input_ids"][row:row + 1], default_position_ids(attention), mask[:, None]


def update_step(chunks: list, optimizer, batch: dict[str, torch.Tensor], loss_fn, *, vocab_size: int,
                temperature: float = 1.0) -> dict[str, float]:
    """One optimizer step over ``batch`` (the training layout), one row per micro-batch through
    Megatron's schedule, on models wrapped in Megatron's ``DistributedDataParallel``.

    ``loss_fn(logprobs, entropy, micro_batch, num_tokens, num_seqs) -> (loss, metrics)`` gets the
    response tokens' log-probs and entropy ``[1, R]`` of one row and the mini-batch's token and row
    counts (so a token-mean is over the whole mini-batch, as in the HF engine). Returns the summed
    metrics (on the last pipeline stage; empty elsewhere) and ``grad_norm``."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows, width = batch["input_ids"].shape
    prompt = width - batch["response_mask"].shape[1]
    num_tokens = batch["response_mask"].sum().float()
    totals: dict[str, torch.Tensor] = {}

    def loss_func(row: int, logits: torch.Tensor):
        logits = logits[:, prompt - 1:-1]  # the positions that predict the response tokens
        targets = batch["input_ids"][row:row + 1, prompt:]
        logprobs = vocab_parallel_logprobs(logits, targets, vocab_size=vocab_size, temperature=temperature)
        with torch.no_grad():
            entropy = vocab_parallel_entropy(logits, vocab_size=vocab_size, temperature=temperature)
        micro_batch = {k: v[row:row + 1] for k, v in batch.items()}
        loss, metrics = loss_fn(logprobs, entropy, micro_batch, num_tokens, rows)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + value.detach().float()
        return loss * rows, {}  # the schedule divides each micro-batch's loss by their number

    def forward_step(row_iter, model):
        row = next(row_iter)
        return model(*_row_inputs(batch, row)), partial(loss_func, row)

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(rows)), model=chunks,
                                num_microbatches=rows, seq_length=width, micro_batch_size=1, forward_only=False)
    finalize_model_grads(chunks)
    _, grad_norm, _ = optimizer.step()
    return {**{k: float(v) for k, v in totals.items()}, "grad_norm": float(grad_norm)}
