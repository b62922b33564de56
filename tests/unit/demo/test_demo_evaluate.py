"""The demo's HF-generate evaluation: response lengths and the evaluate() bookkeeping."""

from __future__ import annotations

import torch

from posttrain.demo.evaluate import _response_lengths, evaluate, load_model


def test_response_lengths_stop_at_first_eos_inclusive():
    new = torch.tensor([[5, 6, 2, 2], [5, 2, 7, 2], [5, 6, 7, 8]])
    assert _response_lengths(new, eos_id=2, pad_id=2) == [3, 2, 4]
    assert _response_lengths(torch.tensor([[5, 0, 0]]), eos_id=2, pad_id=0) == [2]


def test_evaluate_counts_and_scores_every_response(tiny_model_dir):
    model, tok = load_model(tiny_model_dir, threads=1)
    rows = [{"problem": f"p{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)}
            for i in range(3)]
    calls = []

    def scorer(response, answer):
        calls.append(answer)
        return float(answer == "2")  # reward depends only on the row -> no group is mixed

    res = evaluate(model, tok, rows, max_new_tokens=4, batch_size=2, n=2, temperature=1.0,
                   scorer=scorer)
    assert calls == ["1", "1", "2", "2", "3", "3"]
    assert len(res.records) == 6 and res.num_problems == 3
    assert abs(res.accuracy - 2 / 6) < 1e-9
    assert res.mixed_group_fraction == 0.0
    assert all(1 <= r["length"] <= 4 for r in res.records) and res.max_length <= 4
