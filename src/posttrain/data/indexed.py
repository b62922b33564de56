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
    writing). The reader checks what Megatron's checks (magic, version) plus the dtype code and
    that both files are long enough for the index they carry.
    """

    def __init__(self, path_prefix: str | Path):
        self.path_prefix = str(path_prefix)
        idx, binf = idx_path(path_prefix), bin_path(path_prefix)
        for p in (idx, binf):
            if not os.path.isfile(p):
                raise DataError(f"{p}: no such file (indexed datasets need both .idx and .bin)")
        self._read_index(idx)
        nbytes = os.path.getsize(binf)
        need = (int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
                if len(self.sequence_lengths) else 0)
        if nbytes < need:
            raise DataError(f"{binf}: file is truncated ({nbytes} bytes, the index needs {need}); "
                            "re-run preprocessing")
        self._bin = (np.memmap(binf, dtype=self.dtype, mode="r") if nbytes
                     else np.zeros(0, dtype=self.dtype))

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

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


def exists(path_prefix: str | Path) -> bool:
    return os.path.isfile(idx_path(path_prefix)) and os.path.isfile(bin_path(path_prefix))
