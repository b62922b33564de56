"""TransferDock: the experience table that carries data between the stages of one RL iteration.

The table has ``max_len`` rows (one per sample: ``max_len = num_prompts * n_samples_per_prompt``)
and named columns (``prompts``, ``responses``, ``old_logprobs``, ...; the on-policy loop's schema
is in :mod:`posttrain.loops.experience`, in the one vocabulary used from rollout to loss). Each cell holds a 1-D
tensor whose length may differ from row to row (a response of 17 tokens next to one of 512), so a
column is stored as a Python list of tensors, with a boolean *ready* vector beside it. The
columns of :data:`MATRIX_COLUMNS` (a vision-language sample's images) hold a 2-D tensor per cell
instead: ``pixel_values [patches, dim]``, ``image_grid_thw [images, 3]``, ``image_embeds
[image tokens, (1 + D) * H]`` (D: Qwen3-VL's deepstack levels), and the videos' ``pixel_values_videos``,
``video_grid_thw`` (``second_per_grid_ts``: 1-D), each sample with its own number of rows.

Producers ``put`` cells by row index. Consumers (the phases: ``rollout``, ``advantages``, ...)
``get`` rows whose requested columns are all ready and that this consumer has not consumed yet;
each consumer has its own *consumed* vector, so two consumers can read the same rows.

Row choice when no indexes are given:

* ``guarantee_order=True``: the lowest eligible indexes, in ascending order (reproducible runs);
* otherwise: a uniformly random choice among the eligible rows (the seed's ``torch.multinomial``
  with equal weights), drawn from the dock's own seeded ``random.Random``.

``get_n_samples=True`` hands out whole groups only: rows ``[g*n, (g+1)*n)`` of prompt ``g`` are
chosen together, so a group-normalised advantage sees its complete group.

The dock lives in the driver process, also on Ray (docs/cluster.md says why); its state is plain
Python (lists, numpy arrays, tensors, ``random.Random``), so it pickles. With
``rl_config.data_strategy: tq`` the loop's docks are
:class:`~posttrain.cluster.transfer_queue.TransferQueueDock`: the same bookkeeping here, the cells in
TransferQueue's storage units (the four cell-store methods below are what it overrides).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from posttrain.errors import PosttrainError

class TransferDockError(PosttrainError, ValueError):
    """A read or write that the dock cannot serve (bad column, index or dispatch size)."""


# columns whose cells are 2-D (a sample's image inputs: its own number of rows, a fixed width)
MATRIX_COLUMNS = frozenset({"pixel_values", "image_grid_thw", "image_embeds", "pixel_values_videos", "video_grid_thw"})


def _as_rows(values: Any, count: int, column: str) -> list[torch.Tensor]:
    """Split ``values`` into ``count`` 1-D row tensors (2-D for :data:`MATRIX_COLUMNS`).

    Accepts a sequence of tensors/numbers/lists (one per row) or a tensor whose first dim is the
    row dim (a 1-D tensor gives one scalar per row, stored with shape ``[1]``).
    """
    if isinstance(values, torch.Tensor):
        rows = list(values.unbind(0)) if values.dim() > 0 else [values]
    else:
        rows = list(values)
    if len(rows) != count:
        raise TransferDockError(f"put experience ERROR: column {column} got {len(rows)} rows "
                                f"for {count} indexes")
    out = []
    for row in rows:
        t = row if isinstance(row, torch.Tensor) else torch.as_tensor(row)
        if column in MATRIX_COLUMNS:
            if t.dim() != 2:
                raise TransferDockError(f"put experience ERROR: column {column} holds one 2-D tensor per sample "
                                        f"([rows, width]), got shape {tuple(t.shape)}")
            out.append(t)
            continue
        out.append(t.reshape(-1) if t.dim() != 1 else t)
    return out


def pad_rows(rows: Sequence[torch.Tensor], pad_value: float = 0, multiple: int = 1) -> torch.Tensor:
    """Stack variable-length 1-D rows into a right-padded ``[B, T]`` tensor.

    ``T`` is the longest row rounded up to a multiple of ``multiple`` (e.g. the TP size).
    """
    if not rows:
        return torch.empty(0, 0)
    width = max(int(r.numel()) for r in rows)
    width = (width + multiple - 1) // multiple * multiple
    out = torch.full((len(rows), width), pad_value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


class TransferDock:
    """Columns x rows experience table with per-consumer readiness (see the module docstring).

    Args:
        max_len: number of rows (samples) per iteration.
        columns: column names; ``put`` to any other name raises.
        consumers: consumer names; ``get`` for any other name raises.
        n_samples_per_prompt: group size ``n`` (rows of prompt ``g`` are ``g*n .. g*n+n-1``).
        guarantee_order: hand out the lowest eligible indexes in order instead of random ones.
        seed: seed of the dock's random row choice.
    """

    def __init__(self, max_len: int, columns: Iterable[str], consumers: Iterable[str], *,
                 n_samples_per_prompt: int = 1,
                 guarantee_order: bool = False, seed: int = 0) -> None:
        if max_len <= 0:
            raise TransferDockError(f"TD max_len must be positive, got {max_len}")
        if n_samples_per_prompt <= 0 or max_len % n_samples_per_prompt:
            raise TransferDockError(f"TD max_len: {max_len} must be a positive multiple of "
                                    f"n_samples_per_prompt: {n_samples_per_prompt}")
        self.max_len = max_len
        self.n_samples_per_prompt = n_samples_per_prompt
        self.guarantee_order = guarantee_order
        self.columns = list(dict.fromkeys(columns))
        self.consumers = list(dict.fromkeys(consumers))
        self._rng = random.Random(seed)
        self._data: dict[str, list[torch.Tensor | None]] = {}
        self._ready: dict[str, np.ndarray] = {}
        self._consumed: dict[str, np.ndarray] = {}
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        """Empty every cell and reset readiness and consumption (call between iterations)."""
        self._clear_cells(None)
        self._ready = {c: np.zeros(self.max_len, dtype=bool) for c in self.columns}
        self._consumed = {c: np.zeros(self.max_len, dtype=bool) for c in self.consumers}

    def clear_rows(self, indexes: Sequence[int]) -> None:
        """Empty the cells, readiness and consumption of some rows (partial rollout frees the groups
        an update took, and keeps the others)."""
        idx = self._check_indexes(indexes)
        self._clear_cells(idx)
        for c in self.columns:
            self._ready[c][idx] = False
        for c in self.consumers:
            self._consumed[c][idx] = False

    def cell(self, column: str, index: int) -> torch.Tensor | None:
        """The cell of one row (None when not ready)."""
        self._check_columns([column])
        index = self._check_indexes([index])[0]
        return self._read_cells([column], [index])[column][0] if self._ready[column][index] else None

    def ready_rows(self, column: str) -> np.ndarray:
        """A copy of ``column``'s readiness vector."""
        self._check_columns([column])
        return self._ready[column].copy()

    def state_dict(self) -> dict[str, Any]:
        """Cells, readiness, consumption and the row-choice generator (picklable)."""
        return {"data": self._all_cells(),
                "ready": {c: v.copy() for c, v in self._ready.items()},
                "consumed": {c: v.copy() for c, v in self._consumed.items()}, "rng": self._rng.getstate()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state["data"]) != set(self.columns) or len(next(iter(state["data"].values()))) != self.max_len:
            raise TransferDockError(f"a saved TransferDock of columns {sorted(state['data'])} does not fit this one "
                                    f"({self.max_len} rows of {self.columns})")
        self._ready = {c: np.array(state["ready"][c], dtype=bool) for c in self.columns}
        self._clear_cells(None)
        for c in self.columns:
            rows = np.flatnonzero(self._ready[c]).tolist()
            if rows:
                self._write_cells(rows, {c: [state["data"][c][i] for i in rows]})
        self._consumed = {c: np.array(state["consumed"][c], dtype=bool) for c in self.consumers}
        self._rng.setstate(state["rng"])

    # ------------------------------------------------------------------ cell store
    # The cells live in this process (lists of tensors); a subclass keeps them elsewhere by overriding
    # these four (posttrain.cluster.transfer_queue: in TransferQueue's storage actors).
    def _clear_cells(self, indexes: list[int] | None) -> None:
        """Drop the cells of rows ``indexes`` (all rows when None)."""
        if indexes is None:
            self._data = {c: [None] * self.max_len for c in self.columns}
            return
        for c in self.columns:
            for i in indexes:
                self._data[c][i] = None

    def _write_cells(self, indexes: list[int], columns: Mapping[str, list[torch.Tensor]]) -> None:
        """Store ``columns[c][k]`` as the cell of row ``indexes[k]`` in column ``c``."""
        for column, rows in columns.items():
            cells = self._data[column]
            for i, row in zip(indexes, rows):
                cells[i] = row

    def _read_cells(self, columns: Sequence[str], indexes: list[int]) -> dict[str, list[torch.Tensor]]:
        return {c: [self._data[c][i] for i in indexes] for c in columns}

    def _all_cells(self) -> dict[str, list[torch.Tensor | None]]:
        """Every cell, None where not ready (the state to save)."""
        return {c: list(v) for c, v in self._data.items()}

    # ------------------------------------------------------------------ writes
    def put(self, column_names: Sequence[str], indexes: Sequence[int],
            tensors: Sequence[Any]) -> None:
        """Write ``tensors[k]`` (one row per index) into column ``column_names[k]`` and mark ready."""
        if len(column_names) != len(tensors):
            raise TransferDockError(f"put experience ERROR: {len(column_names)} column names "
                                    f"for {len(tensors)} tensors")
        if not len(indexes):
            raise TransferDockError("put experience into TD without indexes, indexes must be provided")
        idx = self._check_indexes(indexes)
        columns = {}
        for col, values in zip(column_names, tensors):
            if col not in self._ready:
                raise TransferDockError(f"put experience ERROR: {col} not in TD experience_column "
                                        f"{self.columns}")
            columns[col] = _as_rows(values, len(idx), col)
        self._write_cells(idx, columns)  # one write of every column (one round trip to TransferQueue)
        for col in columns:
            self._ready[col][idx] = True

    def put_prompts(self, data: Mapping[str, Any], first_prompt: int = 0) -> list[int]:
        """Write each prompt row into its ``n`` sample rows; returns the row indexes written.

        Prompt ``p`` (counting from ``first_prompt``) fills rows ``p*n .. p*n+n-1``.
        """
        n = self.n_samples_per_prompt
        num_prompts = None
        repeated = {}
        for col, values in data.items():
            rows = _as_rows(values, len(values), col)
            num_prompts = len(rows) if num_prompts is None else num_prompts
            if len(rows) != num_prompts:
                raise TransferDockError(f"put experience ERROR: column {col} has {len(rows)} "
                                        f"prompts, expected {num_prompts}")
            repeated[col] = [r for r in rows for _ in range(n)]
        indexes = list(range(first_prompt * n, (first_prompt + (num_prompts or 0)) * n))
        self.put(list(repeated), indexes, list(repeated.values()))
        return indexes

    # ------------------------------------------------------------------ reads
    def get(self, consumer: str, column_names: Sequence[str], experience_count: int | None = None,
            *, indexes: Sequence[int] | None = None, get_n_samples: bool = False,
            ) -> tuple[dict[str, list[torch.Tensor]] | None, list[int] | None]:
        """Read rows for ``consumer``; they are marked consumed for this consumer only.

        Without ``indexes``, ``experience_count`` rows are chosen among the rows that are ready in
        every column of ``column_names`` and not yet consumed by ``consumer``; if fewer are
        eligible, returns ``(None, None)`` (the caller runs the producer first or stops).
        With ``indexes``, exactly those rows are read; they must be ready.

        Returns ``({column: list of 1-D tensors (2-D for MATRIX_COLUMNS)}, indexes)``.
        """
        self._check_consumer(consumer)
        self._check_columns(column_names)
        if indexes is not None:
            chosen = self._check_indexes(indexes)
            not_ready = [i for i in chosen for c in column_names if not self._ready[c][i]]
            if not_ready:
                raise TransferDockError(f"get experience ERROR: rows {sorted(set(not_ready))} are not "
                                        f"ready in columns {list(column_names)} for {consumer}")
        else:
            if experience_count is None:
                raise TransferDockError("get experience ERROR: give experience_count or indexes")
            self._check_experience_count(experience_count, get_n_samples)
            chosen = self._choose(consumer, column_names, experience_count, get_n_samples)
            if chosen is None:
                return None, None
        self._consumed[consumer][chosen] = True
        return self._read_cells(column_names, chosen), chosen

    def _eligible(self, consumer: str, column_names: Sequence[str]) -> np.ndarray:
        mask = ~self._consumed[consumer]
        for col in column_names:
            mask &= self._ready[col]
        return mask

    def _choose(self, consumer: str, column_names: Sequence[str], count: int,
                get_n_samples: bool) -> list[int] | None:
        mask = self._eligible(consumer, column_names)
        if get_n_samples:
            n = self.n_samples_per_prompt
            groups = np.flatnonzero(mask.reshape(-1, n).all(axis=1))
            picked = self._pick(groups.tolist(), count // n)
            if picked is None:
                return None
            return [g * n + j for g in picked for j in range(n)]
        return self._pick(np.flatnonzero(mask).tolist(), count)

    def _pick(self, candidates: list[int], k: int) -> list[int] | None:
        if len(candidates) < k:
            return None
        if self.guarantee_order:
            return candidates[:k]
        return self._rng.sample(candidates, k)

    # ------------------------------------------------------------------ status
    def consumed_count(self, consumer: str) -> int:
        self._check_consumer(consumer)
        return int(self._consumed[consumer].sum())

    def all_consumed(self, consumer: str) -> bool:
        """True once ``consumer`` has read every row."""
        return self.consumed_count(consumer) == self.max_len

    # ------------------------------------------------------------------ checks
    def _check_indexes(self, indexes: Sequence[int]) -> list[int]:
        out = [int(i) for i in indexes]
        if out and max(out) >= self.max_len:
            raise TransferDockError(f"Put experience index {max(out)} exceeds the Transfer Dock range "
                                    f"{self.max_len}.")
        if out and min(out) < 0:
            raise TransferDockError(f"experience index {min(out)} is negative; rows are 0..{self.max_len - 1}")
        return out

    def _check_columns(self, column_names: Sequence[str]) -> None:
        for col in column_names:
            if col not in self._ready:
                raise TransferDockError(f"get experience ERROR: {col} not in TD experience_column "
                                        f"{self.columns}")

    def _check_consumer(self, consumer: str) -> None:
        if consumer not in self._consumed:
            raise TransferDockError(f"get experience ERROR: {consumer} not in TD experience_consumers "
                                    f"{self.consumers}")

    def _check_experience_count(self, count: int, get_n_samples: bool) -> None:
        if count <= 0:
            raise TransferDockError(f"experience_count must be positive, got {count}")
        if self.max_len < count:
            raise TransferDockError(f"TD max_len: {self.max_len} need >= experience_count: {count}")
        if self.max_len % count:
            raise TransferDockError(f"TD max_len:{self.max_len} need be divisible by "
                                    f"experience_count: {count}")
        if get_n_samples and count % self.n_samples_per_prompt:
            raise TransferDockError(f"get_n_samples need experience_count:{count} must be divisible "
                                    f"by n_samples_per_prompt: {self.n_samples_per_prompt}")
