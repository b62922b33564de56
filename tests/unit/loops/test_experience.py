"""The one path between TransferDock rows and the training batch (what the loops use)."""

from __future__ import annotations

import torch

from posttrain.loops.experience import new_dock, read_batch, write_rows


def test_read_batch_builds_the_layout_with_per_token_columns_and_write_rows_cuts_them_back():
    td = new_dock(2, 1, guarantee_order=True, seed=0)
    td.put_prompts({"prompts": [torch.tensor([5, 6]), torch.tensor([7])], "prompt_length": [2, 1],
                    "labels": [torch.tensor([0]), torch.tensor([0])]})
    td.put(["responses", "response_length", "advantages"], [0, 1],
           [[torch.tensor([8]), torch.tensor([9, 10, 11])], [1, 3], [torch.tensor([0.5]), torch.tensor([1.0, 2.0, 3.0])]])
    batch, idx, lengths = read_batch(td, "actor_update", ["advantages"], 2, pad_token_id=0)
    assert idx == [0, 1] and lengths == [1, 3]
    assert batch["input_ids"].tolist() == [[5, 6, 8, 0, 0], [0, 7, 9, 10, 11]]  # prompts left, responses right
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 2, 2], [0, 0, 1, 2, 3]]
    assert batch["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch["advantages"].tolist() == [[0.5, 0, 0], [1.0, 2.0, 3.0]]
    write_rows(td, ["old_logprobs"], idx, [batch["advantages"] * -1], lengths)
    rows, _ = td.get("metrics", ["old_logprobs"], indexes=[0, 1])
    assert [r.tolist() for r in rows["old_logprobs"]] == [[-0.5], [-1.0, -2.0, -3.0]]


def test_empty_responses_keep_one_masked_column():
    td = new_dock(1, 1, guarantee_order=True, seed=0)
    td.put_prompts({"prompts": [torch.tensor([5])], "prompt_length": [1], "labels": [torch.tensor([0])]})
    td.put(["responses", "response_length"], [0], [[torch.tensor([], dtype=torch.long)], [0]])
    batch, _, lengths = read_batch(td, "old_logprobs", [], 1, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 0]] and batch["response_mask"].tolist() == [[0]] and lengths == [0]


def test_multi_turn_rows_zero_exactly_the_tool_tokens_in_the_loss_mask():
    """The dock's response_mask (0 on tool tokens) times the padding mask is the batch's loss mask,
    and the actor loss then ignores whatever sits on tool tokens."""
    from posttrain.training.loss_fns import make_actor_loss_fn
    from posttrain.loops.experience import MULTI_TURN_COLUMNS

    td = new_dock(2, 1, guarantee_order=True, seed=0, extra_columns=MULTI_TURN_COLUMNS)
    td.put_prompts({"prompts": [torch.tensor([5, 6]), torch.tensor([7])], "prompt_length": [2, 1],
                    "labels": [torch.tensor([0]), torch.tensor([0])]})
    td.put(["responses", "response_length", "response_mask", "tool_call_num", "advantages"], [0, 1],
           [[torch.tensor([8, 9, 10, 11, 12]), torch.tensor([13, 14])], [5, 2],
            [torch.tensor([1, 1, 0, 0, 1]), torch.tensor([1, 1])], [1, 0],
            [torch.full((5,), 1.0), torch.full((2,), -1.0)]])
    batch, _, _ = read_batch(td, "actor_update", ["advantages"], 2, pad_token_id=0)
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    loss_fn = make_actor_loss_fn()
    batch["old_logprobs"] = torch.full((2, 5), -1.0)
    logprobs = torch.full((2, 5), -1.0)
    base, _ = loss_fn.after_forward(logprobs, None, batch)
    logprobs[0, 2:4] = -50.0  # only the tool tokens change
    moved, _ = loss_fn.after_forward(logprobs, None, batch)
    assert torch.equal(base, moved)
    logprobs[0, 4] = -50.0  # a sampled token does count
    assert not torch.equal(base, loss_fn.after_forward(logprobs, None, batch)[0])
