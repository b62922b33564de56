"""A seeded sampler that yields batches of indices forever and resumes exactly.

The stream of indices is a sequence of *blocks*; batches are cut from each block in turn::

    shuffle (default)       block e = epoch e = permutation of range(N) drawn from rng(seed, e)
    no_shuffle              block e = range(N)
    full_shuffle            block b = one permutation of range(N) repeated up to total_samples
                            (the seed's full_shuffle_instruction_dataset: the whole training horizon
                            shuffled at once, so epochs mix), drawn from rng(seed, b)

With ``drop_last`` the samples left over at the end of a block (fewer than ``batch_size``) are not
used; otherwise the block's last batch is shorter. The state is ``(block, offset)``: a resumed
sampler yields exactly the batches an uninterrupted one would have yielded next.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from posttrain.errors import ConfigError


class ResumableSampler:
    """``for indices in sampler:`` yields lists of ``batch_size`` ints, forever."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 1234, shuffle: bool = True,
                 drop_last: bool = True, full_shuffle: bool = False, total_samples: int | None = None,
                 consumed_samples: int = 0):
        if num_samples <= 0:
            raise ConfigError("the dataset is empty: no samples to draw from (check max_prompt_length and split)")
        if batch_size <= 0:
            raise ConfigError(f"batch size must be positive (got {batch_size})")
        if full_shuffle and not total_samples:
            raise ConfigError("full_shuffle_instruction_dataset needs the number of training samples "
                              "(train_iters x global_batch_size)")
        self.num_samples, self.batch_size, self.seed = int(num_samples), int(batch_size), int(seed)
        self.shuffle, self.drop_last, self.full_shuffle = bool(shuffle), bool(drop_last), bool(full_shuffle)
        self.total_samples = int(total_samples) if total_samples else None
        if self.drop_last and self.block_size < self.batch_size:
            raise ConfigError(f"batch size {batch_size} is larger than the {self.block_size} samples of an "
                              f"epoch ({num_samples} samples); lower the batch size or add data")
        self.block, self.offset = 0, 0
        self._order: np.ndarray | None = None
        self._order_block = -1
        if consumed_samples:
            self.skip_batches(int(consumed_samples) // self.batch_size)

    @classmethod
    def from_seed_flags(cls, num_samples: int, batch_size: int, seed: int, no_shuffle: bool = False,
                        full_shuffle_instruction_dataset: bool = False, total_samples: int | None = None,
                        consumed_samples: int = 0) -> "ResumableSampler":
        """The seed's flags: ``no_shuffle`` and ``full_shuffle_instruction_dataset``."""
        return cls(num_samples, batch_size, seed, shuffle=not no_shuffle, drop_last=True,
                   full_shuffle=full_shuffle_instruction_dataset, total_samples=total_samples,
                   consumed_samples=consumed_samples)

    @property
    def block_size(self) -> int:
        return self.total_samples if self.full_shuffle else self.num_samples

    @property
    def batches_per_block(self) -> int:
        n = self.block_size // self.batch_size
        return n if self.drop_last or self.block_size % self.batch_size == 0 else n + 1

    def block_order(self, block: int) -> np.ndarray:
        """The index order of one block (an epoch, or the whole horizon with full_shuffle)."""
        if self._order_block != block:
            if self.full_shuffle:
                reps = -(-self.block_size // self.num_samples)
                base = np.tile(np.arange(self.num_samples, dtype=np.int64), reps)[: self.block_size]
                order = np.random.default_rng([self.seed, block]).permutation(base)  # even with no_shuffle
            elif self.shuffle:
                order = np.random.default_rng([self.seed, block]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples, dtype=np.int64)
            self._order, self._order_block = order, block
        return self._order

    def next_batch(self) -> list[int]:
        order = self.block_order(self.block)
        end = min(self.offset + self.batch_size, len(order))
        batch = order[self.offset: end].tolist()
        self.offset = end
        if len(order) - self.offset < (self.batch_size if self.drop_last else 1):
            self.block, self.offset = self.block + 1, 0
        return batch

    def skip_batches(self, n: int) -> None:
        """Advance by ``n`` batches without drawing them (the seed's consumed_samples // gbs skip)."""
        per_block = self.batches_per_block
        total = self.block * per_block + self.offset // self.batch_size + n
        self.block, self.offset = divmod(total, per_block)
        self.offset *= self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    @property
    def epoch(self) -> int:
        return self.block

    def state_dict(self) -> dict:
        return {"block": self.block, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "full_shuffle": self.full_shuffle,
                "total_samples": self.total_samples, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position; the dataset and batching must be those the state was saved with."""
        for key in ("seed", "num_samples", "batch_size", "shuffle", "full_shuffle", "total_samples", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(f"cannot resume the data sampler: {key} was {state[key]!r} when the checkpoint "
                                  f"was saved and is {getattr(self, key)!r} now; keep the dataset, seed and "
                                  "batch size of the run you resume")
        self.block, self.offset = int(state["block"]), int(state["offset"])
