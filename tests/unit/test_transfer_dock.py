"""TransferDock: readiness per column, consumption per consumer, dispatch sizes, groups, errors."""

import pickle

import pytest
import torch

from posttrain.transfer_dock import TransferDock, TransferDockError, pad_rows


def _dock(max_len=8, n=2, **kw):
    return TransferDock(max_len, ["prompts", "responses", "rm_scores", "advantages"],
                        ["rule_reward", "compute_advantage", "actor_train"],
                        n_samples_per_prompt=n, **kw)


def test_put_then_get_returns_variable_length_rows_in_order():
    td = _dock(guarantee_order=True)
    rows = [torch.arange(k + 1) for k in range(8)]
    td.put(["responses"], list(range(8)), [rows])
    batch, idx = td.get("rule_reward", ["responses"], 4)
    assert idx == [0, 1, 2, 3]
    assert [r.tolist() for r in batch["responses"]] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    batch, idx = td.get("rule_reward", ["responses"], 4)
    assert idx == [4, 5, 6, 7]
    assert td.get("rule_reward", ["responses"], 4) == (None, None)
    assert td.all_consumed("rule_reward")
    # another consumer sees all rows again
    _, idx = td.get("actor_train", ["responses"], 8)
    assert idx == list(range(8))


def test_get_only_returns_rows_ready_in_all_requested_columns():
    td = _dock(guarantee_order=True)
    td.put(["responses"], range(8), [torch.zeros(8, 3)])
    td.put(["rm_scores"], [1, 3, 5], [torch.tensor([1.0, 2.0, 3.0])])
    assert td.get("compute_advantage", ["responses", "rm_scores"], 4) == (None, None)
    batch, idx = td.get("compute_advantage", ["responses", "rm_scores"], 2)
    assert idx == [1, 3]
    assert [r.tolist() for r in batch["rm_scores"]] == [[1.0], [2.0]]
    assert td.get("compute_advantage", ["responses", "rm_scores"], 1)[1] == [5]  # the third ready row


def test_random_choice_is_seeded_and_covers_all_rows_once():
    picks = []
    for _ in range(2):
        td = _dock(seed=7)
        td.put(["responses"], range(8), [torch.zeros(8, 1)])
        got = [td.get("rule_reward", ["responses"], 2)[1] for _ in range(4)]
        picks.append(got)
    assert picks[0] == picks[1]
    assert sorted(i for chunk in picks[0] for i in chunk) == list(range(8))


def test_get_n_samples_returns_whole_groups():
    td = _dock(n=4, seed=3)
    # only group 1 (rows 4..7) is complete; row 0 of group 0 is missing
    td.put(["rm_scores"], [1, 2, 3, 4, 5, 6, 7], [torch.ones(7)])
    assert td.get("compute_advantage", ["rm_scores"], 8, get_n_samples=True) == (None, None)
    _, idx = td.get("compute_advantage", ["rm_scores"], 4, get_n_samples=True)
    assert idx == [4, 5, 6, 7]
    with pytest.raises(TransferDockError, match="get_n_samples need experience_count:2 must be "
                                                "divisible by n_samples_per_prompt: 4"):
        td.get("compute_advantage", ["rm_scores"], 2, get_n_samples=True)


def test_put_prompts_repeats_each_prompt_n_times():
    td = _dock(n=2, guarantee_order=True)
    idx = td.put_prompts({"prompts": [torch.tensor([5, 6]), torch.tensor([7])]}, first_prompt=1)
    assert idx == [2, 3, 4, 5]
    batch, _ = td.get("actor_train", ["prompts"], indexes=idx)
    assert [r.tolist() for r in batch["prompts"]] == [[5, 6], [5, 6], [7], [7]]


def test_explicit_indexes_read_in_the_given_order():
    td = TransferDock(8, ["responses", "response_length", "old_logprobs"], ["actor_update"], guarantee_order=True)
    td.put(["responses", "response_length", "old_logprobs"], [0, 1],
           [[torch.tensor([1, 2, 3]), torch.tensor([4])], torch.tensor([3, 1]),
            [torch.tensor([-0.5, -1.0, -2.0]), torch.tensor([-3.0])]])
    batch, idx = td.get("actor_update", ["responses", "response_length", "old_logprobs"], indexes=[1, 0])
    assert idx == [1, 0]
    assert [r.tolist() for r in batch["responses"]] == [[4], [1, 2, 3]]
    assert [r.tolist() for r in batch["old_logprobs"]] == [[-3.0], [-0.5, -1.0, -2.0]]
    with pytest.raises(TransferDockError, match="not ready"):
        td.get("actor_update", ["responses"], indexes=[2])
    assert pad_rows([torch.tensor([1.0]), torch.tensor([2.0, 3.0])]).tolist() == [[1, 0], [2, 3]]


def test_clear_resets_data_readiness_and_consumption():
    td = _dock(guarantee_order=True)
    td.put(["responses"], range(8), [torch.zeros(8, 1)])
    td.get("rule_reward", ["responses"], 8)
    td.clear()
    assert td.consumed_count("rule_reward") == 0
    assert td.get("rule_reward", ["responses"], 8) == (None, None)


@pytest.mark.parametrize("call,message", [
    (lambda td: td.put(["nope"], [0], [[1]]),
     r"put experience ERROR: nope not in TD experience_column \['prompts'"),
    (lambda td: td.put(["responses"], [9, 3], [[1, 2]]),
     r"Put experience index 9 exceeds the Transfer Dock range 8\."),
    (lambda td: td.put(["responses"], [], [[]]),
     r"put experience into TD without indexes, indexes must be provided"),
    (lambda td: td.get("rule_reward", ["responses"], 16), r"TD max_len: 8 need >= experience_count: 16"),
    (lambda td: td.get("rule_reward", ["responses"], 3), r"TD max_len:8 need be divisible by experience_count: 3"),
    (lambda td: td.get("nobody", ["responses"], 2), r"nobody not in TD experience_consumers"),
    (lambda td: td.put(["responses"], [0, 1], [[1]]), r"got 1 rows for 2 indexes"),
])
def test_seed_error_messages(call, message):
    with pytest.raises(TransferDockError, match=message):
        call(_dock())


def test_dock_pickles_with_its_state():
    td = _dock(seed=1)
    td.put(["responses"], [0, 1], [[torch.tensor([1, 2]), torch.tensor([3])]])
    td.get("rule_reward", ["responses"], indexes=[0])
    clone = pickle.loads(pickle.dumps(td))
    assert clone.consumed_count("rule_reward") == 1
    assert clone.get("actor_train", ["responses"], indexes=[0, 1])[0]["responses"][1].tolist() == [3]
    assert clone.get("rule_reward", ["responses"], 1)[1] == td.get("rule_reward", ["responses"], 1)[1] == [1]


def test_image_columns_keep_each_samples_2d_cells():
    td = TransferDock(4, ["prompts", "pixel_values", "image_grid_thw"], ["actor_log_prob"], n_samples_per_prompt=2,
                      guarantee_order=True)
    pixels = [torch.arange(12.0).reshape(4, 3), torch.arange(30.0).reshape(10, 3)]  # 4 and 10 patches
    grids = [torch.tensor([[1, 2, 2]]), torch.tensor([[1, 2, 2], [1, 2, 3]])]  # one image, two images
    td.put_prompts({"prompts": [torch.tensor([5, 6]), torch.tensor([7])], "pixel_values": pixels,
                    "image_grid_thw": grids})
    batch, idx = td.get("actor_log_prob", ["prompts", "pixel_values", "image_grid_thw"], 4)
    assert idx == [0, 1, 2, 3]
    assert [tuple(p.shape) for p in batch["pixel_values"]] == [(4, 3), (4, 3), (10, 3), (10, 3)]
    assert torch.equal(batch["pixel_values"][3], pixels[1])
    assert [g.tolist() for g in batch["image_grid_thw"]] == [[[1, 2, 2]]] * 2 + [[[1, 2, 2], [1, 2, 3]]] * 2
    assert batch["prompts"][2].tolist() == [7]  # other columns stay 1-D
    with pytest.raises(TransferDockError, match=r"pixel_values holds one 2-D tensor per sample.*\(12,\)"):
        td.put(["pixel_values"], [0], [[torch.arange(12.0)]])
