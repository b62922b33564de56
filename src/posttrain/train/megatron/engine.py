"""The Megatron-Core backend's passes (issue 17, in progress): next-token log-probs and entropy of
a batch through Megatron's pipeline schedule, from vocab-parallel logits.

So far only the forward pass the trainer's log-prob calls need; the update comes next.
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
