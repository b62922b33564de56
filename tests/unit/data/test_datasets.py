"""Training-side datasets (prompt filter, split, SFT/pairwise items) and the resumable sampler."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.data import preprocess as pp
from posttrain.data.datasets import (PairwiseDataset, PromptDataset, ResumableSampler, SFTDataset,
                                     position_ids, split_range)
from posttrain.data.indexed import IndexedDatasetBuilder
from posttrain.errors import ConfigError, DataError
from tests.unit.data.test_preprocess import _cfg, _jsonl_bytes, _row


def _write(prefix, key, seqs):
    b = IndexedDatasetBuilder(f"{prefix}_packed_{key}_document.bin")
    for s in seqs:
        b.add_item(s)
        b.end_document()
    b.finalize(f"{prefix}_packed_{key}_document.idx")


@pytest.fixture
def prompts(tmp_path):
    prefix = str(tmp_path / "data")
    lengths = [3, 5, 4, 6, 2]
    _write(prefix, "input_ids", [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lengths)])
    _write(prefix, "attention_mask", [[1] * n for n in lengths])
    _write(prefix, "labels", [[100 + i] for i in range(5)])
    return prefix


def test_prompt_dataset_filter_is_strict(prompts):
    ds = PromptDataset(prompts, max_prompt_length=5)
    assert len(ds) == 3 and ds.num_filtered == 2  # lengths 5 and 6 dropped, 3/4/2 kept
    assert [ds[i]["labels"].tolist() for i in range(3)] == [[100], [102], [104]]
    assert ds[1]["prompts"].tolist() == [20, 21, 22, 23] and ds[1]["prompts"].dtype == np.int32
    assert len(PromptDataset(prompts, max_prompt_length=None)) == 5
    assert set(ds[0]) == {"prompts", "labels"}


def test_prompt_dataset_split_and_missing_field(prompts):
    assert split_range("100,0,0", 5) == (0, 5)
    assert split_range("60,20,20", 5, "train") == (0, 3) and split_range("60,20,20", 5, "valid") == (3, 4)
    assert split_range("60,20,20", 5, 2) == (4, 5)
    ds = PromptDataset(prompts, 100, split="60,20,20", split_part="valid")
    assert len(ds) == 1 and ds[0]["labels"].tolist() == [103]
    with pytest.raises(DataError, match="field.*answer missing"):
        PromptDataset(prompts, 100, additional_keys=("answer",))
    with pytest.raises(DataError, match="Run `posttrain preprocess`"):
        PromptDataset(prompts + "_nope", 100)


def test_mismatched_fields_are_an_error(prompts):
    _write(prompts, "labels", [[1]])
    with pytest.raises(DataError, match="different row counts"):
        PromptDataset(prompts, 100)


def test_sft_and_pairwise_items(tmp_path):
    prefix = str(tmp_path / "sft")
    _write(prefix, "input_ids", [[5, 6, 7, 8, 0, 0]])
    _write(prefix, "labels", [[-100, 6, -100, 8, -100, -100]])
    _write(prefix, "attention_mask", [[1, 1, 2, 2, 0, 0]])  # neat-packed: two samples + padding
    item = SFTDataset(prefix, seq_length=6)[0]
    assert item["position_ids"].tolist() == [0, 1, 0, 1, 0, 1]
    assert SFTDataset(prefix, seq_length=3)[0]["labels"].tolist() == [-100, 6, -100]
    assert position_ids(np.ones(4, dtype=np.int32)).tolist() == [0, 1, 2, 3]
    pw = str(tmp_path / "dpo")
    for key, seqs in {"chosen_input_ids": [[1, 2, 3]], "chosen_labels": [[-100, 2, 3]],
                      "rejected_input_ids": [[1, 4]], "rejected_labels": [[-100, 4]]}.items():
        _write(pw, key, seqs)
    item = PairwiseDataset(pw)[0]
    assert item["rejected_input_ids"].tolist() == [1, 4] and item["chosen_labels"].tolist() == [-100, 2, 3]


# --- sampler ----------------------------------------------------------------------------
def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_sampler_epochs_are_permutations_and_seeded():
    s = ResumableSampler(10, 3, seed=7)
    batches = _take(s, 9)  # 3 batches per epoch (drop_last), 3 epochs
    for e in range(3):
        epoch = sum(batches[3 * e: 3 * e + 3], [])
        assert len(set(epoch)) == 9 and set(epoch) <= set(range(10))
    assert batches[:3] != batches[3:6]  # reshuffled per epoch
    assert _take(ResumableSampler(10, 3, seed=7), 9) == batches
    assert _take(ResumableSampler(10, 3, seed=8), 9) != batches


def test_sampler_resume_gives_identical_next_batch():
    ref = _take(ResumableSampler(10, 3, seed=1), 12)
    s = ResumableSampler(10, 3, seed=1)
    first = _take(s, 5)
    state = s.state_dict()
    resumed = ResumableSampler(10, 3, seed=1)
    resumed.load_state_dict(state)
    assert first + _take(resumed, 7) == ref
    # the seed's consumed_train_samples skip lands on the same batch
    assert _take(ResumableSampler(10, 3, seed=1, consumed_samples=15), 7) == ref[5:]
    with pytest.raises(ConfigError, match="batch_size was 3"):
        ResumableSampler(10, 4, seed=1).load_state_dict(state)


def test_sampler_no_shuffle_and_not_drop_last():
    assert _take(ResumableSampler(5, 2, shuffle=False), 4) == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert _take(ResumableSampler(5, 2, shuffle=False, drop_last=False), 4) == [[0, 1], [2, 3], [4], [0, 1]]
    s = ResumableSampler(5, 2, shuffle=False, drop_last=False)
    s.skip_batches(3)
    assert next(iter(s)) == [0, 1]


def test_sampler_full_shuffle_mixes_epochs():
    s = ResumableSampler.from_seed_flags(4, 2, seed=3, no_shuffle=True, full_shuffle_instruction_dataset=True,
                                         total_samples=12)
    horizon = sum(_take(s, 6), [])
    assert sorted(horizon) == sorted(list(range(4)) * 3)  # each sample 3 times over the horizon
    firsts = [sorted(horizon[i: i + 4]) for i in range(0, 12, 4)]
    assert any(f != [0, 1, 2, 3] for f in firsts)  # epochs are not kept apart
    with pytest.raises(ConfigError, match="needs the number of training samples"):
        ResumableSampler(4, 2, full_shuffle=True)
    with pytest.raises(ConfigError, match="larger than"):
        ResumableSampler(4, 5)


# ---- bad datasets are refused when opened (the reliability probe) ------------------------------------
def test_empty_prompt_names_the_file_and_row(tmp_path):
    """Probes D24, D25, D26, D27: a prompt dataset whose row 7 has no tokens (a consistent index) is refused when opened."""
    prefix = str(tmp_path / "data")
    for key, lens in (("input_ids", [3] * 7 + [0] + [3] * 2), ("labels", [1] * 10)):
        b = IndexedDatasetBuilder(f"{prefix}_packed_{key}_document.bin")
        b.add_items(np.ones(sum(lens)), np.array(lens))
        b.finalize(f"{prefix}_packed_{key}_document.idx")
    with pytest.raises(DataError, match=r"input_ids_document\.idx: row 7 is an empty prompt"):
        PromptDataset(prefix)


def test_sft_dataset_refuses_a_prompt_dataset(tmp_path, tok_dir):
    """Probe D29: the sft stage pointed at an RL prompt dataset."""
    path = _jsonl_bytes(tmp_path / "in.jsonl", [_row("What is 1 + 1?", "2"), _row("What is 2 + 2?", "4")])
    pp.preprocess(_cfg(tmp_path, tok_dir, path), progress=False)
    prefix = str(tmp_path / "out" / "data")
    with pytest.raises(DataError, match=rf"data_path {prefix} is not an SFT dataset: row 0 has \d+ input_ids tokens "
                                        r"but 1 labels.*handler_name=AlpacaStyleInstructionHandler"):
        SFTDataset(prefix, seq_length=32)
