"""Pack SFT samples into fixed-length rows (the seed's ``pack: true``): greedy knapsack.

Knapsacks are filled one at a time: with ``remaining = capacity``, repeatedly take the longest
remaining sample whose length is ``<= remaining``, until none fits (the seed's ``greedy_knapsack``
over lengths sorted ascending). ``capacity = seq_length - 1``; each packed row is then padded to
exactly ``seq_length`` (input ``pad_id``, label -100, attention mask 1, or 0 with ``neat_pack``).

With ``neat_pack`` the attention mask holds ``k + 1`` on the tokens of the ``k``-th sample of the
row, so that a trainer can keep samples from attending to each other and restart positions.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque

import numpy as np

from posttrain.data.handlers import IGNORE_INDEX


def greedy_knapsack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into knapsacks of total length ``<= capacity``.

    Items longer than ``capacity`` must be removed before (they fit nowhere).
    """
    by_length: dict[int, deque[int]] = defaultdict(deque)
    for i, n in enumerate(lengths):
        assert n <= capacity, "items longer than the capacity must be filtered out first"
        by_length[n].append(i)
    distinct = sorted(by_length)
    packs = []
    while distinct:
        remaining, pack = capacity, []
        while True:
            pos = bisect.bisect_right(distinct, remaining) - 1
            if pos < 0:
                break
            n = distinct[pos]
            pack.append(by_length[n].popleft())
            remaining -= n
            if not by_length[n]:
                del distinct[pos]
                del by_length[n]
        packs.append(pack)
    return packs


def pack_samples(input_ids: list[np.ndarray], labels: list[np.ndarray], seq_length: int, pad_id: int,
                 neat_pack: bool = False) -> dict[str, list[np.ndarray]]:
    """Packed rows ``{"input_ids", "attention_mask", "labels"}``, each row exactly ``seq_length`` long."""
    packs = greedy_knapsack([len(x) for x in input_ids], seq_length - 1)
    out: dict[str, list[np.ndarray]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for pack in packs:
        ids = np.full(seq_length, pad_id, dtype=np.int32)
        lab = np.full(seq_length, IGNORE_INDEX, dtype=np.int32)
        mask = np.full(seq_length, 0 if neat_pack else 1, dtype=np.int32)
        pos = 0
        for k, i in enumerate(pack):
            n = len(input_ids[i])
            ids[pos: pos + n] = input_ids[i]
            lab[pos: pos + n] = labels[i]
            mask[pos: pos + n] = k + 1 if neat_pack else 1
            pos += n
        out["input_ids"].append(ids)
        out["attention_mask"].append(mask)
        out["labels"].append(lab)
    return out
