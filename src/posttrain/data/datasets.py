"""Training-side datasets over ``{prefix}_packed_{field}_document.{bin,idx}`` files.

* :class:`PromptDataset` (GRPO/DAPO/PPO): items ``{"prompts": int32[P], "labels": int32[L], ...}``.
  Prompts with ``len >= max_prompt_length`` are dropped (strict ``<`` kept, as the seed), the same
  rows are dropped from every field, then ``split`` (e.g. ``"100,0,0"``) partitions the rest.
* :class:`SFTDataset`: items ``{"input_ids", "labels", "attention_mask", "position_ids"}``.
  ``labels`` are aligned with ``input_ids`` and **not shifted**: ``labels[t] == input_ids[t]`` on
  answer tokens and ``-100`` (:data:`posttrain.data.handlers.IGNORE_INDEX`) on prompt and padding tokens, so the loss of
  token ``t`` uses ``logits[t - 1]`` (the Hugging Face convention). Packed rows (``pack: true``)
  are ``seq_length`` long; with ``neat_pack`` their attention mask numbers the samples
  (1, 2, ...; 0 = padding) and ``position_ids`` restart at 0 for each sample.
* :class:`PairwiseDataset` (DPO, reward models): ``chosen_input_ids``, ``chosen_labels``,
  ``rejected_input_ids``, ``rejected_labels`` (labels as in SFT).
* :class:`UnpairedPreferenceDataset` (KTO): ``input_ids``, ``labels`` (as in SFT) and ``desirable``
  (one id per row: 1 desirable, 0 undesirable), from ``UnpairedPreferenceHandler``.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import numpy as np

from posttrain.data.indexed import IndexedDataset
from posttrain.data.sampler import ResumableSampler
from posttrain.errors import ConfigError, DataError

__all__ = ["PromptDataset", "SFTDataset", "PairwiseDataset", "UnpairedPreferenceDataset", "ResumableSampler",
           "find_fields", "split_range"]

SPLIT_NAMES = {"train": 0, "valid": 1, "validation": 1, "test": 2}


def find_fields(data_prefix: str | Path) -> dict[str, str]:
    """``field -> path prefix`` for every ``{data_prefix}_packed_{field}_document.{bin,idx}`` pair."""
    prefix = str(data_prefix)
    pattern = re.compile(re.escape(os.path.basename(prefix)) + r"_packed_(.*)_document\.idx$")
    fields = {}
    for idx in sorted(glob.glob(glob.escape(prefix) + "_packed_*_document.idx")):
        m = pattern.match(os.path.basename(idx))
        if m and os.path.isfile(idx[: -len(".idx")] + ".bin"):
            fields[m.group(1)] = idx[: -len(".idx")]
    if not fields:
        raise DataError(f"data_path {prefix}: no files {prefix}_packed_*_document.{{bin,idx}}. Run "
                        "`posttrain preprocess` with output_prefix set to this prefix first.")
    return fields


def split_range(split: str | list | None, size: int, part: int | str = 0) -> tuple[int, int]:
    """``[start, end)`` of ``part`` (0/train, 1/valid, 2/test) under weights like ``"100,0,0"``.

    Megatron's rule: weights normalised to sum 1, boundaries ``round(w * size)`` accumulated, and
    the last boundary moved to ``size``.
    """
    if split is None:
        return 0, size
    if isinstance(part, str):
        if part not in SPLIT_NAMES:
            raise ConfigError(f"split part {part!r} is unknown; known: {', '.join(SPLIT_NAMES)}")
        part = SPLIT_NAMES[part]
    raw = split.replace("/", ",").split(",") if isinstance(split, str) else list(split)
    try:
        weights = [float(w) for w in raw if str(w).strip() != ""]
    except ValueError:
        raise ConfigError(f"split {split!r}: expected comma-separated numbers such as 100,0,0") from None
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    total = sum(weights)
    if total <= 0 or any(w < 0 for w in weights):
        raise ConfigError(f"split {split!r}: weights must be >= 0 and not all 0")
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * size)))
    diff = bounds[-1] - size
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return max(bounds[part], 0), max(bounds[part + 1], 0)


class _FieldsDataset:
    """Several indexed fields with the same number of rows, seen through a row index."""

    def __init__(self, data_prefix: str | Path, required: list[str], optional: list[str] = ()):
        self.data_prefix = str(data_prefix)
        found = find_fields(data_prefix)
        missing = [f for f in required if f not in found]
        if missing:
            raise DataError(f"data_path {data_prefix}: field(s) {', '.join(missing)} missing; found "
                            f"{', '.join(sorted(found))}. Was it preprocessed with the right handler "
                            "(and dataset_additional_keys)?")
        self.fields = {f: IndexedDataset(found[f]) for f in [*required, *optional] if f in found}
        for f, d in self.fields.items():
            if d.dtype.kind not in "iu":
                raise DataError(f"{d.path_prefix}.idx: dtype {d.dtype} is not an integer type, so these are not "
                                "token ids; re-run posttrain preprocess")
        sizes = {f: len(d) for f, d in self.fields.items()}
        if len(set(sizes.values())) > 1:
            raise DataError(f"data_path {data_prefix}: fields have different row counts {sizes}; "
                            "the files come from different preprocessing runs. Re-run preprocessing.")
        self.rows = np.arange(next(iter(sizes.values())), dtype=np.int64)

    def _lengths(self, field: str) -> np.ndarray:
        return np.asarray(self.fields[field].sequence_lengths)

    def _first_length_mismatch(self, a: str, b: str) -> int | None:
        """The first row where fields ``a`` and ``b`` (both present) differ in length, else None."""
        if a not in self.fields or b not in self.fields:
            return None
        differ = self._lengths(a) != self._lengths(b)
        return int(np.argmax(differ)) if differ.any() else None

    def _check_same_lengths(self, a: str, b: str) -> None:
        i = self._first_length_mismatch(a, b)
        if i is not None:
            raise DataError(f"data_path {self.data_prefix}: row {i} has {self._lengths(a)[i]} {a} tokens but "
                            f"{self._lengths(b)[i]} {b} tokens ({self.fields[b].path_prefix}.idx); they must be "
                            "equal. Re-run posttrain preprocess.")

    def _select(self, keep: np.ndarray | None, split, split_part) -> None:
        if keep is not None:
            self.rows = self.rows[keep]
        start, end = split_range(split, len(self.rows), split_part)
        self.rows = self.rows[start:end]

    def __len__(self) -> int:
        return len(self.rows)

    def _get(self, field: str, i: int) -> np.ndarray:
        return np.array(self.fields[field][int(self.rows[i])], dtype=np.int32)


class PromptDataset(_FieldsDataset):
    """RL prompts. ``ds[i] = {"prompts": int32 ids, <each additional key>: int32 ids}``."""

    def __init__(self, data_prefix: str | Path, max_prompt_length: int | None = None,
                 additional_keys: tuple[str, ...] | list[str] = ("labels",), split: str | None = None,
                 split_part: int | str = "train"):
        self.additional_keys = list(additional_keys)
        super().__init__(data_prefix, ["input_ids", *self.additional_keys], ["attention_mask"])
        lengths = self._lengths("input_ids")
        if len(lengths) and lengths.min() == 0:
            raise DataError(f"{self.fields['input_ids'].path_prefix}.idx: row {int(np.argmin(lengths))} is an empty "
                            "prompt (0 tokens); every prompt needs at least one token. Re-run posttrain preprocess.")
        self._check_same_lengths("input_ids", "attention_mask")
        keep = lengths < max_prompt_length if max_prompt_length else None
        self.num_filtered = int((~keep).sum()) if keep is not None else 0
        self._select(keep, split, split_part)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        item = {"prompts": self._get("input_ids", i)}
        for key in self.additional_keys:
            item[key] = self._get(key, i)
        return item

    def prompt_lengths(self) -> np.ndarray:
        return np.asarray(self.fields["input_ids"].sequence_lengths)[self.rows]


class SFTDataset(_FieldsDataset):
    """SFT samples (plain or packed). Sequences longer than ``seq_length`` are truncated."""

    def __init__(self, data_prefix: str | Path, seq_length: int | None = None, split: str | None = None,
                 split_part: int | str = "train"):
        super().__init__(data_prefix, ["input_ids", "labels"], ["attention_mask"])
        i = self._first_length_mismatch("input_ids", "labels")
        if i is not None:
            ids, labels = self._lengths("input_ids")[i], self._lengths("labels")[i]
            raise DataError(
                f"data_path {data_prefix} is not an SFT dataset: row {i} has {ids} input_ids tokens but {labels} "
                "labels, and an SFT row has one label per token. An RL prompt dataset "
                "(R1AlpacaStyleInstructionHandler) keeps the answer as labels. For the sft stage, preprocess the "
                "data with handler_name=AlpacaStyleInstructionHandler (e.g. --config-name tiny_add_sft).")
        self._check_same_lengths("input_ids", "attention_mask")
        self.seq_length = seq_length
        self._select(None, split, split_part)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        ids, labels = self._get("input_ids", i), self._get("labels", i)
        mask = self._get("attention_mask", i) if "attention_mask" in self.fields else np.ones_like(ids)
        if self.seq_length:
            ids, labels, mask = ids[: self.seq_length], labels[: self.seq_length], mask[: self.seq_length]
        return {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": position_ids(mask)}


def position_ids(attention_mask: np.ndarray) -> np.ndarray:
    """0, 1, ... restarting where the mask value changes (neat-packed segments); plain masks: arange."""
    n = len(attention_mask)
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    starts = np.flatnonzero(np.r_[True, attention_mask[1:] != attention_mask[:-1]])
    seg_start = np.repeat(starts, np.diff(np.r_[starts, n]))
    return (np.arange(n) - seg_start).astype(np.int32)


class PairwiseDataset(_FieldsDataset):
    """Pairwise (DPO / reward model) samples; no length filter (as the seed)."""

    KEYS = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]

    def __init__(self, data_prefix: str | Path, seq_length: int | None = None, split: str | None = None,
                 split_part: int | str = "train"):
        super().__init__(data_prefix, self.KEYS)
        for side in ("chosen", "rejected"):
            self._check_same_lengths(f"{side}_input_ids", f"{side}_labels")
        self.seq_length = seq_length
        self._select(None, split, split_part)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {k: self._get(k, i)[: self.seq_length] if self.seq_length else self._get(k, i) for k in self.KEYS}



class UnpairedPreferenceDataset(_FieldsDataset):
    """Unpaired preference (KTO) rows: a prompt and completion as one SFT row, and its label."""

    KEYS = ["input_ids", "labels", "desirable"]

    def __init__(self, data_prefix: str | Path, seq_length: int | None = None, split: str | None = None,
                 split_part: int | str = "train"):
        super().__init__(data_prefix, self.KEYS)
        self._check_same_lengths("input_ids", "labels")
        lengths = self._lengths("desirable")
        bad = np.flatnonzero(lengths != 1)
        if len(bad) == 0:
            values = self.fields["desirable"].first_tokens().astype(np.int64)
            bad = np.flatnonzero((values != 0) & (values != 1))
        if len(bad):
            raise DataError(f"data_path {data_prefix}: row {int(bad[0])} of desirable "
                            f"({self.fields['desirable'].path_prefix}.idx) is not one 0/1 label; re-run posttrain "
                            "preprocess with handler_name: UnpairedPreferenceHandler")
        self.desirable = values.astype(bool)
        self.seq_length = seq_length
        self._select(None, split, split_part)

    def label_counts(self) -> tuple[int, int]:
        """(desirable, undesirable) rows of this split."""
        chosen = int(self.desirable[self.rows].sum())
        return chosen, len(self.rows) - chosen

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        ids, labels = self._get("input_ids", i), self._get("labels", i)
        if self.seq_length:
            ids, labels = ids[: self.seq_length], labels[: self.seq_length]
        return {"input_ids": ids, "labels": labels, "desirable": self._get("desirable", i)}
