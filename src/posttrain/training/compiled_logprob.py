"""The LM head's log-softmax-gather as a compiled region: a chunk's logits in, its tokens' log-probs
(and entropies) out, without the head's matmul.

:func:`posttrain.training.lm_head.head_logprobs` applies the head to a chunk of tokens, then reduces
the chunk's ``[N, V]`` logits to ``N`` log-probs: eager PyTorch divides by the temperature, takes a
logsumexp (a max and a sum of exponentials), gathers the labels' logits and, for the entropy,
multiplies the softmax by the logits and sums, each a pass over the vocabulary; its backward is
another pass (:class:`posttrain.algo.logprob._LabelLogProb`). Compiled (``torch.compile``,
TorchInductor's CPU backend, ``dynamic=True`` for the last chunk's shorter length), the passes fuse
into a few loops forward and one backward; the matmul stays on the linear layer's kernel
(oneDNN or the BLAS). :func:`fused_regions <posttrain.training.fused_regions.fused_regions>` turns
the region on for its ``with`` block (:func:`active`); the head uses it where there is no
truncation (a truncated distribution sorts or takes a top-k per token: eager).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch

_STATE = threading.local()  # per thread: an asynchronous rollout's thread keeps the eager log-probs


def _depth() -> int:
    return getattr(_STATE, "depth", 0)  # how many enclosing blocks of this thread turned the region on


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool,
                         entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / temperature)[labels]`` for ``logits [N, V]`` and ``labels [N]``, in
    float32, and with ``with_entropy`` the entropies of ``softmax(logits / temperature)`` (with a
    gradient only with ``entropy_grad``): the formulas of
    :func:`posttrain.algo.logprob.scaled_logprobs_and_entropy`."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = torch.gather(z, -1, labels[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, None
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    return logprobs, entropy if entropy_grad else entropy.detach()


@functools.lru_cache(maxsize=None)
def compiled_logprobs_and_entropy():
    """:func:`logprobs_and_entropy` compiled once per process (its forward and backward on first use)."""
    return torch.compile(logprobs_and_entropy, dynamic=True, options={"compile_threads": 1})


def active() -> bool:
    """Whether the LM head's log-probs go through the compiled region now, in this thread."""
    return _depth() > 0


@contextlib.contextmanager
def logprob_region() -> Iterator[None]:
    """Inside, :func:`active` is true."""
    _STATE.depth = _depth() + 1
    try:
        yield
    finally:
        _STATE.depth = _depth() - 1
