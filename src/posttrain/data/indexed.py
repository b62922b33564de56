"""Megatron ``MMIDIDX`` indexed datasets: a ``.bin`` of raw tokens and an ``.idx`` of offsets.

The layout is byte-compatible with ``megatron.core.datasets.indexed_dataset.IndexedDataset``.
``.idx`` (little-endian)::

    magic            b"MMIDIDX\\x00\\x00"                9 bytes
    version          uint64 = 1
    dtype code       uint8   (see DTYPE_CODES)
    sequence_count   uint64  S
    document_count   uint64  D (length of document_indices, = S + 1 here)
    sequence_lengths int32[S]  tokens per sequence
    sequence_ptrs    int64[S]  byte offset of each sequence in .bin
    document_indices int64[D]  0, then the sequence count after each end_document()
    (sequence_modes  int8[S]   multimodal only; never written here)

``.bin`` is the sequences' tokens back to back, C order, in the dtype of the header.
Tokens are int32 by default so that ``-100`` labels fit.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from posttrain.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5,
               np.float64: 6, np.float32: 7, np.uint16: 8}
CODE_DTYPES = {code: np.dtype(t) for t, code in DTYPE_CODES.items()}
_HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8
_RERUN = "; re-run posttrain preprocess"


def idx_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


def bin_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for t, code in DTYPE_CODES.items():
        if np.dtype(t) == dtype:
            return code
    raise DataError(f"dtype {dtype} cannot be stored in an MMIDIDX dataset; use one of "
                    f"{', '.join(str(np.dtype(t)) for t in DTYPE_CODES)}")


class IndexedDatasetBuilder:
    """Append sequences to ``bin_file``; :meth:`finalize` writes the ``.idx``.

    Each :meth:`add_item` adds one sequence; :meth:`end_document` closes a document (the
    preprocessing job makes every sample its own document, as the seed does).
    """

    def __init__(self, bin_file: str | Path, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self.bin_file = str(bin_file)
        self._out = open(self.bin_file, "wb")  # noqa: SIM115 (closed in finalize/close)
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """One sequence (any int sequence or array), cast to the builder's dtype."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._out.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def add_items(self, flat: np.ndarray, lengths: np.ndarray, end_documents: bool = True) -> None:
        """Many sequences at once: ``flat`` holds them back to back, ``lengths`` their sizes."""
        flat = np.ascontiguousarray(flat, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        assert int(lengths.sum()) == flat.size, "lengths must add up to the flat token count"
        self._out.write(flat.tobytes())
        start = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in lengths)
        if end_documents:
            self.document_indices.extend(range(start + 1, len(self.sequence_lengths) + 1))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str | Path) -> None:
        """Append a whole existing dataset (used to merge shards)."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{path_prefix}: dtype {other.dtype} differs from {self.dtype}; cannot merge")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(int(n) for n in other.sequence_lengths)
        self.document_indices.extend(offset + int(d) for d in other.document_indices[1:])
        with open(bin_path(path_prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._out.write(chunk)

    def finalize(self, idx_file: str | Path) -> None:
        """Close the ``.bin`` and write the ``.idx`` next to it."""
        self._out.close()
        write_index(idx_file, self.dtype, self.sequence_lengths, self.document_indices)

    def close(self) -> None:
        if not self._out.closed:
            self._out.close()


def write_index(idx_file: str | Path, dtype, sequence_lengths, document_indices) -> None:
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(idx_file, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(docs.tobytes(order="C"))


class IndexedDataset:
    """Read-only, memory-mapped view of ``{path_prefix}.idx`` + ``{path_prefix}.bin``.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the mapped ``.bin``; copy it before
    writing). The reader checks what Megatron's checks (magic, version) plus, when it opens the
    files (vectorised over the mapped index, a few ms per million rows): the dtype code, the
    ``.idx`` size against its header, every length (>= 0) and pointer (``pointer[i]`` = the bytes
    of the rows before it: Megatron writes the rows back to back, so the ``.bin`` is exactly as long
    as the rows), and the document indices (0, non-decreasing, ending at the row count). An error
    names the file and the first bad row.
    """

    def __init__(self, path_prefix: str | Path):
        self.path_prefix = str(path_prefix)
        idx, binf = idx_path(path_prefix), bin_path(path_prefix)
        for p in (idx, binf):
            if not os.path.isfile(p):
                raise DataError(f"{p}: no such file (indexed datasets need both .idx and .bin)")
        self._read_index(idx)
        nbytes = os.path.getsize(binf)
        self._check_rows(idx, binf, nbytes)
        self._bin = (np.memmap(binf, dtype=self.dtype, mode="r") if nbytes
                     else np.zeros(0, dtype=self.dtype))

    def _check_rows(self, idx: str, binf: str, nbytes: int) -> None:
        """Lengths, pointers and document indices against each other and the ``.bin`` size."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        n, size = len(lengths), self.dtype.itemsize
        total = 0
        if n:
            if lengths.min() < 0:
                i = int(np.argmax(lengths < 0))
                raise DataError(f"{idx}: row {i} has a negative length ({int(lengths[i])}){_RERUN}")
            row_bytes = lengths.astype(np.int64)
            row_bytes *= size
            # pointer[0] == 0 and each pointer is the previous one plus the previous row's bytes
            # (a difference, not a cumsum: 4x faster, and equivalent by induction)
            if pointers[0] != 0 or not np.array_equal(pointers[1:] - pointers[:-1], row_bytes[:-1]):
                self._bad_pointer(idx, nbytes, row_bytes, np.cumsum(row_bytes))
            total = int(pointers[-1]) + int(row_bytes[-1])
        if nbytes < total:
            first = int(np.searchsorted(np.cumsum(row_bytes), nbytes, side="right"))
            raise DataError(f"{binf}: file is truncated ({nbytes} bytes, the index needs {total}; row {first} "
                            f"is the first past the end); re-run preprocessing")
        if nbytes > total:
            raise DataError(f"{binf}: {nbytes} bytes, but the rows of {idx} take {total} bytes: the .bin and the "
                            f".idx do not belong together{_RERUN}")
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n:
            got = "none" if len(docs) == 0 else f"{int(docs[0])} ... {int(docs[-1])}"
            raise DataError(f"{idx}: document indices must run from 0 to the row count {n} (got {got}){_RERUN}")
        if len(docs) > 1:
            down = docs[1:] < docs[:-1]
            if down.any():
                j = int(np.argmax(down)) + 1
                raise DataError(f"{idx}: document index {j - 1} is {int(docs[j - 1])} but document index {j} is "
                                f"{int(docs[j])}; document indices must not decrease{_RERUN}")

    def _bad_pointer(self, idx: str, nbytes: int, row_bytes: np.ndarray, ends: np.ndarray) -> None:
        """Raise for the first row whose pointer is not where the rows before it end."""
        pointers, lengths = self.sequence_pointers, self.sequence_lengths
        start_ok = (pointers >= 0) & (pointers <= nbytes)
        inside = start_ok & (row_bytes <= nbytes - np.clip(pointers, 0, nbytes))
        if not inside.all():
            i = int(np.argmin(inside))
            if not start_ok[i]:
                raise DataError(f"{idx}: row {i} points at byte {int(pointers[i])} but the .bin has {nbytes} bytes"
                                f"{_RERUN}")
            raise DataError(f"{idx}: row {i} is {int(lengths[i])} tokens long ({int(row_bytes[i])} bytes from byte "
                            f"{int(pointers[i])}) but the .bin has {nbytes} bytes{_RERUN}")
        expected = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]])
        i = int(np.argmax(pointers != expected))
        if i == 0:
            raise DataError(f"{idx}: row 0 points at byte {int(pointers[0])} but the first row starts at byte 0{_RERUN}")
        raise DataError(f"{idx}: row {i} points at byte {int(pointers[i])} but row {i - 1} ({int(lengths[i - 1])} tokens "
                        f"from byte {int(pointers[i - 1])}) ends at byte {int(pointers[i - 1]) + int(row_bytes[i - 1])}; "
                        f"the rows are stored back to back{_RERUN}")

    def _read_index(self, idx: str) -> None:
        with open(idx, "rb") as f:
            header = f.read(_HEADER_SIZE)
        if header[: len(MAGIC)] != MAGIC:
            raise DataError(f"bad header, cannot read: {idx} (not an MMIDIDX index file)")
        if len(header) < _HEADER_SIZE:
            raise DataError(f"{idx}: truncated header")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise DataError(f"bad version, cannot read: {idx} (version {version}, expected {VERSION})")
        (code,) = struct.unpack("<B", header[17:18])
        if code not in CODE_DTYPES:
            raise DataError(f"{idx}: unknown dtype code {code}")
        self.dtype = CODE_DTYPES[code]
        count, doc_count = struct.unpack("<QQ", header[18:34])
        expected = _HEADER_SIZE + count * (4 + 8) + doc_count * 8
        actual = os.path.getsize(idx)
        if actual < expected:
            raise DataError(f"{idx}: file is truncated ({actual} bytes, header says {expected}); "
                            "re-run preprocessing")
        if actual not in (expected, expected + count):  # + count: Megatron's multimodal sequence_modes
            raise DataError(f"{idx}: {actual} bytes, but the header ({count} rows, {doc_count} document indices) "
                            f"says {expected}{_RERUN}")
        buf = np.memmap(idx, dtype=np.uint8, mode="r")
        off = _HEADER_SIZE
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=count, offset=off)
        off += count * 4
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=count, offset=off)
        off += count * 8
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=doc_count, offset=off)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"IndexedDataset indices must be integers, not {type(i).__name__}")
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} sequences in {self.path_prefix}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self._bin[start: start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        seq = self[i]
        end = None if length is None else offset + length
        return seq[offset:end]

    def first_tokens(self) -> np.ndarray:
        """The first token of every row, in one read (every row must have one)."""
        assert len(self) == 0 or self.sequence_lengths.min() > 0, "a row is empty"
        return np.asarray(self._bin[self.sequence_pointers // self.dtype.itemsize])

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


def exists(path_prefix: str | Path) -> bool:
    return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))
