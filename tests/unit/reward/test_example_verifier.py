"""The worked example in examples/custom_verifier scores as its README says."""

import sys
from pathlib import Path

import pytest

from posttrain.reward.verifiers import VERIFIERS, import_verifier_modules

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "custom_verifier"


@pytest.fixture(scope="module", autouse=True)
def _example_on_path():
    sys.path.insert(0, str(EXAMPLE))
    import_verifier_modules(["my_rewards"])
    yield
    sys.path.remove(str(EXAMPLE))


@pytest.mark.parametrize("response,label,expected", [
    ("It is Paris.\nAnswer: Paris", "Paris", 1.0),
    ("Answer:  Blue   WHALE!", "blue whale", 1.0),
    ("Answer: lyon", "Paris", 0.1),
    ("I think it's Paris.", "Paris", 0.0),
])
def test_word_answer(response, label, expected):
    assert VERIFIERS.get("word_answer").fn(response, label) == expected


def test_short_and_correct_uses_the_prompt():
    fn = VERIFIERS.get("short_and_correct").fn
    assert fn("\\boxed{17}", "17", prompt="What is 8 + 9?") == 1.0
    long = "blah " * 100 + "\\boxed{17}"  # 510 chars, budget 64 -> cost min(0.5, 446 / 256)
    assert fn(long, "17", prompt="What is 8 + 9?") == 0.5
