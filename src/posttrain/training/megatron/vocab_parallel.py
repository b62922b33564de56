"""Token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

With tensor parallelism Megatron-Core's output layer leaves each TP rank the logits of its slice
of the (padded) vocabulary, ``[..., V_padded / tp]``. Gathering them costs a full ``[..., V]``
tensor per rank; these functions reduce scalars per token instead:

* log-prob of the target: Megatron-Core's ``vocab_parallel_cross_entropy`` (its own autograd),
  negated, on ``logits / temperature``;
* entropy ``H = log Z - E_p[z]`` with ``z = logits / temperature``: each rank sums ``exp(z - m)``
  and ``exp(z - m) * z`` over its slice (``m`` the max over all ranks), and the sums are
  all-reduced with ``reduce_from_tensor_model_parallel_region`` (forward all-reduce, backward
  identity: every rank holds the same loss, so each shard's gradient is its own);
* the padding Megatron adds to the vocabulary (rows beyond ``vocab_size``) is masked out, so the
  results are those of the unpadded model (the HF backend's).

Used inside Megatron's process groups (``megatron.core.parallel_state`` initialised).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """``logits`` ([..., V_local], this rank's slice) with the padded vocabulary entries at -inf."""
    local = logits.shape[-1]
    start = tp_rank * local
    if start + local <= vocab_size:
        return logits
    keep = torch.arange(start, start + local, device=logits.device) < vocab_size
    return logits.masked_fill(~keep, float("-inf"))


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                            temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per token ``[...]`` from this rank's vocab slice ``[..., V_local]`` (fp32)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    z = mask_vocab_padding(logits.float() / temperature, vocab_size, ps.get_tensor_model_parallel_rank())
    return -vocab_parallel_cross_entropy(z.contiguous(), targets)


def vocab_parallel_entropy(logits: torch.Tensor, *, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the token distribution ``[...]`` from this rank's vocab slice ``[..., V_local]``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = ps.get_tensor_model_parallel_group()
    z = mask_vocab_padding(logits.float() / temperature, vocab_size, ps.get_tensor_model_parallel_rank())
    top = z.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)  # a constant shift: no gradient needed
    e = torch.exp(z - top)
    finite_z = torch.where(torch.isfinite(z), z, torch.zeros_like(z))  # padded entries: e = 0, z*e = 0
    total = reduce_from_tensor_model_parallel_region(e.sum(dim=-1).contiguous(), group)
    weighted = reduce_from_tensor_model_parallel_region((e * finite_z).sum(dim=-1).contiguous(), group)
    return torch.log(total) + top.squeeze(-1) - weighted / total
