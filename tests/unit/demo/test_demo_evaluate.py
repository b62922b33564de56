"""The helpers of the demo's measurement scripts in examples/demo: the HF-generate evaluation
(response lengths, evaluate() bookkeeping) and the integer-answer scorer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "demo"


@pytest.fixture(scope="module", autouse=True)
def _example_on_path():
    """The scripts import these helpers as sibling modules, so the tests do the same."""
    sys.path.insert(0, str(EXAMPLE))
    yield
    sys.path.remove(str(EXAMPLE))
    for name in ("demo_eval", "demo_scoring"):
        sys.modules.pop(name, None)


@pytest.fixture
def demo_eval():
    import demo_eval

    return demo_eval


@pytest.fixture
def demo_scoring():
    import demo_scoring

    return demo_scoring


def test_response_lengths_stop_at_first_eos_inclusive(demo_eval):
    new = torch.tensor([[5, 6, 2, 2], [5, 2, 7, 2], [5, 6, 7, 8]])
    assert demo_eval._response_lengths(new, eos_id=2, pad_id=2) == [3, 2, 4]
    assert demo_eval._response_lengths(torch.tensor([[5, 0, 0]]), eos_id=2, pad_id=0) == [2]


def test_evaluate_counts_and_scores_every_response(demo_eval, tiny_model_dir):
    model, tok = demo_eval.load_model(tiny_model_dir, threads=1)
    rows = [{"problem": f"p{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)}
            for i in range(3)]
    calls = []

    def scorer(response, answer):
        calls.append(answer)
        return float(answer == "2")  # reward depends only on the row -> no group is mixed

    res = demo_eval.evaluate(model, tok, rows, max_new_tokens=4, batch_size=2, n=2, temperature=1.0,
                             scorer=scorer)
    assert calls == ["1", "1", "2", "2", "3", "3"]
    assert len(res.records) == 6 and res.num_problems == 3
    assert abs(res.accuracy - 2 / 6) < 1e-9
    assert res.mixed_group_fraction == 0.0
    assert all(1 <= r["length"] <= 4 for r in res.records) and res.max_length <= 4


@pytest.mark.parametrize(
    ("text", "strict", "expected"),
    [
        ("so \\boxed{12} and later 13", True, "12"),
        ("<answer> -4 </answer>", True, "-4"),
        ("3 + 4 = 7. The answer is 7.", True, "7"),
        ("The answer is: 1,234", True, "1234"),
        ("2 + 6 - 8 = 0", True, None),
        ("2 + 6 - 8 = 0", False, "0"),
        ("no numbers", False, None),
    ],
)
def test_extract_answer(demo_scoring, text, strict, expected):
    assert demo_scoring.extract_answer(text, strict=strict) == expected


def test_score(demo_scoring):
    assert demo_scoring.score("The answer is 15.", "15") == 1.0
    assert demo_scoring.score("The answer is 16.", "15") == 0.0
    assert demo_scoring.score("9 + 6 = 15", "15") == 0.0
    assert demo_scoring.score("9 + 6 = 15", "15", strict=False) == 1.0


def test_get_scorer_wraps_a_registered_verifier(demo_scoring):
    assert demo_scoring.get_scorer("demo_lenient")("9 + 6 = 15", "15") == 1.0
    assert demo_scoring.get_scorer("math_equiv")("The answer is 15.", "15") == 1.0
