"""MMIDIDX round trip, byte layout, reader checks, merge, and Megatron-Core compatibility."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from posttrain.data.datasets import PromptDataset
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


# ---- a corrupt .idx is detected when the dataset is opened (the reliability probe) -------------------
ROWS = 1000  # 4 tokens each: the input_ids .bin has 16000 bytes, as in the probe
HEADER = 34  # magic 9 + version 8 + dtype 1 + count 8 + document count 8


def _prompt_dataset(tmp_path) -> str:
    """A prompt dataset written with the project's writer: 1000 prompts of 4 tokens, answers of 1-3."""
    prefix = str(tmp_path / "data")
    rng = np.random.default_rng(0)
    lengths = {"input_ids": np.full(ROWS, 4), "attention_mask": np.full(ROWS, 4),
               "labels": rng.integers(1, 4, ROWS)}
    for key, lens in lengths.items():
        b = IndexedDatasetBuilder(f"{prefix}_packed_{key}_document.bin")
        b.add_items(rng.integers(1, 300, int(lens.sum())), lens)
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    return prefix


def _reads(ds: PromptDataset) -> list[list[list[int]]]:
    return [[v.tolist() for v in ds[i].values()] for i in range(len(ds))]


def _pointer_500_far_out(raw: bytearray, rng) -> None:
    o = HEADER + 4 * ROWS + 8 * 500
    raw[o:o + 8] = struct.pack("<q", 10**12)


def _length_10_is_2_30(raw: bytearray, rng) -> None:
    o = HEADER + 4 * 10
    raw[o:o + 4] = struct.pack("<i", 2**30)


def _pointers_0_to_n_2_past_the_end(raw: bytearray, rng) -> None:
    o = HEADER + 4 * ROWS
    raw[o:o + 8 * (ROWS - 1)] = np.full(ROWS - 1, 16000, np.int64).tobytes()


def _pointers_0_to_n_2_shuffled(raw: bytearray, rng) -> None:
    o = HEADER + 4 * ROWS
    ptrs = np.frombuffer(bytes(raw[o:o + 8 * (ROWS - 1)]), np.int64).copy()
    rng.shuffle(ptrs)
    raw[o:o + 8 * (ROWS - 1)] = ptrs.tobytes()


CORRUPTIONS = {
    "pointer_far_out": (_pointer_500_far_out,
                        r"input_ids_document\.idx: row 500 points at byte 1000000000000 but the \.bin has 16000 bytes"
                        r"; re-run posttrain preprocess"),
    "length_2_30": (_length_10_is_2_30, r"input_ids_document\.idx: row 10 is 1073741824 tokens long"),
    "pointers_0_to_n_2_past_the_end": (_pointers_0_to_n_2_past_the_end,
                                       r"input_ids_document\.idx: row 0 is 4 tokens long \(16 bytes from byte 16000\)"),
    "pointers_0_to_n_2_shuffled": (_pointers_0_to_n_2_shuffled, r"input_ids_document\.idx: row \d+ points at byte \d+"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS) + [f"byte_flips_seed{s}_{n}" for s in range(12) for n in (1, 50)])
def test_corrupt_index_names_the_file_and_row(tmp_path, case):
    """Probes D24, D25, D26, D27: a pointer far out, a length of 2^30, pointers past the end or shuffled, random byte flips."""
    prefix = _prompt_dataset(tmp_path)
    before = _reads(PromptDataset(prefix))
    idx = f"{prefix}_packed_input_ids_document.idx"
    raw = bytearray(open(idx, "rb").read())
    if case in CORRUPTIONS:
        corrupt, message = CORRUPTIONS[case]
        corrupt(raw, np.random.default_rng(1))
        open(idx, "wb").write(bytes(raw))
        with pytest.raises(DataError, match=message):
            PromptDataset(prefix)
        with pytest.raises(DataError, match=message):  # the reader itself, not only the dataset
            IndexedDataset(idx[: -len(".idx")])
        return
    seed, flips = (int(x) for x in case[len("byte_flips_seed"):].split("_"))
    rng = np.random.default_rng(seed)
    for pos in rng.choice(len(raw), size=flips, replace=False):
        raw[pos] = (raw[pos] + int(rng.integers(1, 256))) % 256  # always a different byte
    open(idx, "wb").write(bytes(raw))
    try:
        after = _reads(PromptDataset(prefix))
    except DataError as err:
        assert "input_ids_document.idx" in str(err) or "input_ids_document.bin" in str(err), err
        return
    assert after == before, "a corrupt index was read as different data without an error"
