"""MMIDIDX round trip, byte layout, reader checks, merge, and Megatron-Core compatibility."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from posttrain.data.indexed import IndexedDataset, IndexedDatasetBuilder
from posttrain.errors import DataError

SEQS = [[1, 2, 3], [], [-100, 7], [2**31 - 1]]


def _write(prefix, seqs=SEQS):
    b = IndexedDatasetBuilder(f"{prefix}.bin")
    for s in seqs:
        b.add_item(s)
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return str(prefix)


def test_round_trip(tmp_path):
    ds = IndexedDataset(_write(tmp_path / "d"))
    assert len(ds) == 4 and ds.dtype == np.int32
    for i, s in enumerate(SEQS):
        assert ds[i].dtype == np.int32 and ds[i].tolist() == s
    assert ds[-1].tolist() == SEQS[-1]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        ds[4]


def test_byte_layout(tmp_path):
    prefix = _write(tmp_path / "d", [[5, 6], [7]])
    raw = open(prefix + ".idx", "rb").read()
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 4) + struct.pack("<Q", 2)
                + struct.pack("<Q", 3) + np.array([2, 1], np.int32).tobytes()
                + np.array([0, 8], np.int64).tobytes() + np.array([0, 1, 2], np.int64).tobytes())
    assert raw == expected
    assert open(prefix + ".bin", "rb").read() == np.array([5, 6, 7], np.int32).tobytes()


def test_add_items_equals_add_item(tmp_path):
    a = _write(tmp_path / "a", [[1, 2], [3], [4, 5, 6]])
    b = IndexedDatasetBuilder(tmp_path / "b.bin")
    b.add_items(np.array([1, 2, 3, 4, 5, 6]), np.array([2, 1, 3]))
    b.finalize(tmp_path / "b.idx")
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(str(tmp_path / "b") + ext, "rb").read()


def test_merge_with_add_index(tmp_path):
    a, b = _write(tmp_path / "a", [[1], [2, 3]]), _write(tmp_path / "b", [[4, 5, 6]])
    m = IndexedDatasetBuilder(tmp_path / "m.bin")
    m.add_index(a)
    m.add_index(b)
    m.finalize(tmp_path / "m.idx")
    ds = IndexedDataset(tmp_path / "m")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1], [2, 3], [4, 5, 6]]
    assert ds.document_indices.tolist() == [0, 1, 2, 3]


def test_reader_checks(tmp_path):
    prefix = _write(tmp_path / "d")
    raw = bytearray(open(prefix + ".idx", "rb").read())
    bad = tmp_path / "bad"
    (tmp_path / "bad.bin").write_bytes(open(prefix + ".bin", "rb").read())
    (tmp_path / "bad.idx").write_bytes(b"XXIDIDX\x00\x00" + raw[9:])
    with pytest.raises(DataError, match="bad header, cannot read"):
        IndexedDataset(bad)
    (tmp_path / "bad.idx").write_bytes(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    with pytest.raises(DataError, match="bad version, cannot read"):
        IndexedDataset(bad)
    (tmp_path / "bad.idx").write_bytes(bytes(raw))
    (tmp_path / "bad.bin").write_bytes(open(prefix + ".bin", "rb").read()[:-4])
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(bad)
    with pytest.raises(DataError, match="no such file"):
        IndexedDataset(tmp_path / "missing")


@pytest.mark.slow  # importing megatron-core takes ~10-20 s
def test_megatron_core_reads_our_files(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core --no-deps)")
    pytest.importorskip("torch")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    prefix = _write(tmp_path / "d")
    ours, theirs = IndexedDataset(prefix), MegatronIndexed(prefix)
    assert len(theirs) == len(ours)
    for i, s in enumerate(SEQS):
        assert theirs[i].dtype == np.int32 and theirs[i].tolist() == s
    assert theirs.document_indices.tolist() == ours.document_indices.tolist()

    # and the other way: Megatron's builder writes, our reader reads, bytes identical to ours
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder as MegatronBuilder

    mb = MegatronBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    for s in SEQS:
        mb.add_item(torch_tensor(s))
        mb.end_document()
    mb.finalize(str(tmp_path / "m.idx"))
    back = IndexedDataset(tmp_path / "m")
    assert [back[i].tolist() for i in range(len(back))] == SEQS
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"m{ext}").read_bytes() == open(prefix + ext, "rb").read()


def torch_tensor(seq):
    import torch

    return torch.tensor(seq, dtype=torch.int32)
