"""Dynamic batch size (``rl_config.use_dynamic_bsz``): micro-batches formed by a token budget.

Instead of a fixed number of rows, the rows of a batch are split into ``k`` micro-batches of
balanced token counts (seed section 7.6)::

    k = max(ceil(sum(lengths) / max_tokens), ceil(B / max_rows))   (max-reduced over DP ranks)

then the Karmarkar-Karp largest-differencing method (:func:`karmarkar_karp`) partitions the rows
into ``k`` groups of nearly equal token sums. If a group still exceeds the budget (or the row cap),
``k`` grows by one and the partition is redone, so every micro-batch fits. Each sequence must fit
the budget alone (``prompt_len + response_len <= max_tokens``; the seed's docs recommend
``2 x (max_prompt_length + max_tokens)``).

The gradient equals the fixed-micro-batch path: the training engine normalises every micro-batch
loss by the token (or sequence) count of the whole **mini-batch**, so summing the micro-batch
gradients gives the same step whatever the rows' grouping; ``tests/unit/perf`` checks it.
Outputs of log-prob passes are put back in the original row order by the engine.

Per-phase budgets (``ref_``, ``actor_`` (old log-probs), ``update_`` prefixes) are derived once by
:func:`posttrain.config.plan.token_budgets` and reach the engine in its ``EngineOptions``.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence

from posttrain.training.options import TokenBudget
from posttrain.errors import ConfigError


def karmarkar_karp(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Partition row indices into ``k`` groups with nearly equal sums of ``lengths``.

    Largest differencing method, k-way: every row starts as a k-tuple of subsets (the row alone
    in one of them); the two tuples with the largest spread (max sum - min sum) are merged by
    pairing the heaviest subset of one with the lightest of the other, until one tuple remains.
    Groups come back sorted by their smallest index; empty groups (``k > len(lengths)``) are dropped.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    heap = []
    for i, length in enumerate(lengths):
        subsets = [(int(length), [i])] + [(0, []) for _ in range(k - 1)]
        heap.append((-int(length), i, subsets))
    heapq.heapify(heap)
    tie = len(lengths)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda s: -s[0])  # heaviest first
        b = sorted(b, key=lambda s: s[0])  # lightest first
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, b)]
        sums = [s for s, _ in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tie, merged))
        tie += 1
    groups = [sorted(idx) for _, idx in heap[0][2] if idx] if heap else []
    return sorted(groups, key=lambda g: g[0])


def num_micro_batches(lengths: Sequence[int], budget: TokenBudget,
                      reduce_max: Callable[[int], int] | None = None) -> int:
    """``k`` of the module docstring; ``reduce_max`` max-reduces it over data-parallel ranks."""
    total = int(sum(lengths))
    k = max(1, math.ceil(total / budget.max_tokens))
    if budget.max_rows:
        k = max(k, math.ceil(len(lengths) / budget.max_rows))
    return reduce_max(k) if reduce_max is not None else k


def _fits(groups: list[list[int]], lengths: Sequence[int], budget: TokenBudget) -> bool:
    return all(sum(lengths[i] for i in g) <= budget.max_tokens and (not budget.max_rows or len(g) <= budget.max_rows)
               for g in groups)


def split_by_tokens(lengths: Sequence[int], budget: TokenBudget,
                    reduce_max: Callable[[int], int] | None = None) -> list[list[int]]:
    """Row indices of each micro-batch: balanced by tokens, each within ``budget``."""
    longest = max(lengths, default=0)
    if longest > budget.max_tokens:
        raise ConfigError(
            f"A sequence of {longest} tokens does not fit the dynamic batch token budget of {budget.max_tokens}; "
            "raise rl_config.max_packing_token_size (and the ref_/actor_/update_ variants) to at least "
            "max_prompt_length + max_tokens (the seed's docs recommend twice that).")
    if not lengths:
        return []
    k = num_micro_batches(lengths, budget, reduce_max)
    while True:
        groups = karmarkar_karp(lengths, k)
        if _fits(groups, lengths, budget) or k >= len(lengths):
            return groups
        k += 1


def _swap_down(shares: list[list[int]], lengths: Sequence[int]) -> None:
    """Swap one row of the heaviest share for a shorter one of the lightest, the pair closest to
    half their gap, while that lowers the heaviest share's sum (at most ``len(lengths)`` swaps)."""
    for _ in range(sum(len(s) for s in shares)):
        sums = [sum(int(lengths[i]) for i in share) for share in shares]
        heavy, light = sums.index(max(sums)), sums.index(min(sums))
        gap = sums[heavy] - sums[light]
        by_length = sorted(shares[light], key=lambda i: int(lengths[i]))
        light_lengths = [int(lengths[i]) for i in by_length]
        best = None  # (distance from gap / 2, position in heavy, position in light)
        for a, row in enumerate(shares[heavy]):
            want = int(lengths[row]) - gap / 2  # the light row's length that evens the two shares
            at = bisect.bisect_left(light_lengths, want)
            for b in (at - 1, at):
                if 0 <= b < len(by_length) and 0 < int(lengths[row]) - light_lengths[b] < gap:
                    score = abs(light_lengths[b] - want)
                    if best is None or score < best[0]:
                        best = (score, a, shares[light].index(by_length[b]))
        if best is None:
            return
        _, a, b = best
        shares[heavy][a], shares[light][b] = shares[light][b], shares[heavy][a]


def balanced_shares(lengths: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Row indices in ``len(sizes)`` shares of exactly ``sizes[i]`` rows with nearly equal sums of
    ``lengths`` (``rl_config.use_dp_batch_balance``: one share per data-parallel replica).

    Longest processing time first with count caps: the rows, longest first (ties: lower index),
    each go to the share with the smallest sum that still has room (ties: the lower share); then
    :func:`_swap_down` trades rows between the heaviest and the lightest share while that lowers the
    heaviest. The contiguous cut into the same sizes is kept instead when its largest sum is no larger, so the
    result is never worse balanced than contiguous shares (and equal to them on uniform lengths).
    Each share's indices are sorted.
    """
    if sum(sizes) != len(lengths) or any(size < 0 for size in sizes):
        raise ValueError(f"share sizes {list(sizes)} do not cover {len(lengths)} rows")
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    contiguous = [list(range(bounds[i], bounds[i + 1])) for i in range(len(sizes))]
    shares: list[list[int]] = [[] for _ in sizes]
    sums = [0] * len(sizes)
    for row in sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i)):
        open_shares = [s for s in range(len(sizes)) if len(shares[s]) < sizes[s]]
        target = min(open_shares, key=lambda s: (sums[s], s))
        shares[target].append(row)
        sums[target] += int(lengths[row])
    _swap_down(shares, lengths)

    def largest(groups: list[list[int]]) -> int:
        return max((sum(int(lengths[i]) for i in g) for g in groups), default=0)

    if largest(contiguous) <= largest(shares):
        return contiguous
    return [sorted(share) for share in shares]
