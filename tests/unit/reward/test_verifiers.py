"""Table-driven tests of every built-in verifier: each score value, positive and negative cases."""

import random
import re

import pytest

from posttrain.reward.verifiers import VERIFIERS
from posttrain.reward.verifiers.extract import last_boxed, r1_format_ok
from posttrain.reward.verifiers.seed_math import math_equal

R1 = ("<think>\nStep 1: 30 + 4 = 34.\nStep 2: check the sum.\nStep 3: done.\n</think>\n"
      "<answer>The answer is \\boxed{34}</answer>")


@pytest.mark.parametrize("name", ["format", "strict_format", "step", "base_acc", "acc"])
def test_seed_example_scores_one(name):
    # the seed's tests/ut/models/test_verifier.py: one R1-format response with \boxed{34}
    assert VERIFIERS.get(name).fn(R1, "34") == 1.0


CASES = {
    "format": [
        (R1, "34", 1.0),
        ("<think>a</think><answer>b</answer>", "", 1.0),
        ("<think>a</think>\n<answer>b</answer>\ntrailing", "", 1.0),  # seed's MULTILINE $
        ("<think>a</think>x<answer>b</answer>", "", 0.0),
        ("<answer>b</answer>", "", 0.0),
        ("<think>a</think><answer>b</answer> tail", "", 0.0),
    ],
    "strict_format": [
        (R1, "34", 1.0),
        ("<think>a</think><answer>17</answer>", "", -0.5),                        # no boxed
        ("<think>a</think><answer>\\boxed{1}\\boxed{2}</answer>", "", -0.5),       # two boxed
        ("<think>a</think><answer>\\boxed{1}</answer> extra", "", -0.5),           # not at the end
        ("<think>a</think>\\boxed{1}<answer></answer>", "", -0.5),                 # boxed outside
        ("<think><think>a</think><answer>\\boxed{1}</answer>", "", -0.5),          # two <think>
    ],
    "step": [
        (R1, "", 1.0),
        ("First, add. Next, carry.", "", pytest.approx(2 / 3)),
        ("1. a\n2. b", "", pytest.approx(1 / 3)),  # ^ without MULTILINE: only the first line
        ("no steps here", "", 0.0),
    ],
    "base_acc": [
        (R1, "34", 1.0),
        (R1, "35", 0.0),
        ("\\boxed{34}", "34", 0.0),  # format required
        ("<think>a</think><answer>\\boxed{\\frac{1}{2}}</answer>", "0.5", 1.0),
    ],
    "acc": [
        (R1, "34", 1.0),
        (R1, "35", -0.5),
        ("the answer is 34", "34", -1.0),     # no boxed
        ("\\boxed{}", "34", -1.0),            # nothing extracted
        ("<|im_start|>assistant\n\\boxed{34}<|im_end|>\\boxed{35}", "34", 1.0),
        ("\\boxed{50\\%}", "0.5", 1.0),       # percentage tolerance
        ("\\boxed{1.0001}", "1", 1.0),        # rel_tol 1e-4
        ("\\boxed{1.1}", "1", -0.5),
        ("\\boxed{x+2n+1}", "x+1", -0.5),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
    ],
    "math_17k_acc": [
        ("so \\boxed{34}", "34", 1.0),
        ("\\boxed{33} no, \\boxed{35}", "34", 0.0),
        ("34", "34", 0.0),
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{1+x}", "x+1", 1.0),
    ],
    "acc_for_ppo": [
        ("\\boxed{34}", "34", 1.0),
        ("\\boxed{35}", "34", 0.0),
    ],
    "acc_for_dapo": [
        ("work...\nAnswer: 34", "34", 1.0),
        ("Answer: $34$ dollars", "34", 1.0),
        ("Answer: 1,000", "1000", 1.0),
        ("Answer: \\frac12", "\\frac{1}{2}", 1.0),
        ("Answer: 35", "34", -1.0),
        ("34", "34", -1.0),
        ("Answer: 34" + "x" * 400, "34", -1.0),  # only the last 300 characters count
    ],
    "math_verify_reward": [
        (R1, "34", 1.0),
        (R1, "35", 0.0),
        ("\\boxed{34}", "34", 0.0),  # format required
    ],
    "math_equiv": [
        ("... so the answer is 17.", "17", 1.0),
        ("<answer>17</answer>", "17", 1.0),
        ("<answer>The answer is 17.</answer>", "17", 1.0),
        ("<answer>The answer is 16.</answer>", "17", 0.0),
        ("\\boxed{17}", "17", 1.0),
        ("\\boxed{16 or 17}", "17", 0.0),
        ("\\boxed{17.0}", "17", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{x+1}", "1+x", 1.0),
        ("the answer is 18.", "17", 0.0),
        ("\\boxed{16}", "17", 0.0),
        ("\\boxed{}", "17", 0.0),
        ("no answer", "17", 0.0),
        ("\\boxed{17}", "", 0.0),
    ],
    "answer_number": [
        ("<answer>17</answer>", "17", 1.0),
        ("<answer>x = 17.0</answer>", "17", 1.0),
        ("<answer>17</answer>", "Natalia sold 48/2 = 24 ... #### 17", 1.0),
        ("<answer>16</answer>", "17", 0.0),
        ("17", "17", 0.0),  # no tag
    ],
    "last_number": [
        ("3 + 14 = 17.", "17", 1.0),
        ("it costs $1,000", "1000", 1.0),
        ("0.75", "3/4", 1.0),
        ("17 then 18", "17", 0.0),
        ("no number", "17", 0.0),
    ],
    "answer_is": [
        ("7 * 8 = 56. The answer is 56.", "56", 1.0),
        ("The Answer is: **56**", "56", 1.0),
        ("the answer is 1,200 dollars", "1200", 1.0),
        ("The answer is 7 * 8.", "56", 0.0),  # math_equiv evaluates this to 56: the demo's reward hack
        ("The answer is 55. No, the answer is 56.", "56", 1.0),  # the last statement counts
        ("7 * 8 = 56", "56", 0.0),  # no statement
    ],
    "gsm8k": [
        ("so #### 72", "72", 1.0),
        ("#### 72", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
        ("72", "72", 0.0),
        ("#### 71", "72", 0.0),
    ],
    "retool_reward": [
        ("\\boxed{34}", "34", 1.0),
        ("\\boxed{35}", "34", -1.0),
    ],
}


@pytest.mark.parametrize("name,response,label,expected",
                         [(n, r, lab, e) for n, rows in CASES.items() for r, lab, e in rows])
def test_verifier_table(name, response, label, expected):
    assert VERIFIERS.get(name).fn(response, label) == expected


def test_every_score_value_is_covered():
    seen = {name: {e for _, _, e in rows if isinstance(e, float)} for name, rows in CASES.items()}
    assert seen["acc"] == {1.0, -0.5, -1.0}
    assert seen["strict_format"] == {1.0, -0.5}
    assert seen["acc_for_dapo"] == {1.0, -1.0}
    for name in ("format", "base_acc", "math_17k_acc", "acc_for_ppo", "math_verify_reward", "math_equiv"):
        assert seen[name] == {1.0, 0.0}, name


def test_retool_tool_call_shaping():
    fn = VERIFIERS.get("retool_reward").fn
    assert fn("\\boxed{35}", "34", tool_call_num=3) == pytest.approx(-0.7)
    assert fn("\\boxed{35}", "34", tool_call_num=20) == 0.0
    assert fn("\\boxed{34}", "34", tool_call_num=20) == 1.0


def test_seed_grader_values():
    # the seed's tests/ut/utils/test_grader.py
    assert not math_equal("x+1", "x+2n+1")
    assert math_equal("1", "1.0")
    assert math_equal("1", "1.0001")
    assert not math_equal("1", "1.1")


_TOKENS = ["<think>", "</think>", "<answer>", "</answer>", "\\boxed{", "}", "x", "\n", " "]


def _random_texts(n=3000, seed=0):
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = [rng.choice(_TOKENS) for _ in range(rng.randint(0, 10))]
        if rng.random() < 0.5:
            parts = ["<think>"] + parts + ["</answer>"]
        texts.append("".join(parts))
    return texts


def test_linear_format_checks_match_the_seed_regexes():
    loose = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>$", re.DOTALL | re.MULTILINE)
    full = re.compile(r"<think>.*</think>.*<answer>.*\\boxed\{.*\}.*</answer>", re.DOTALL)
    fmt = VERIFIERS.get("format").fn
    for text in _random_texts():
        assert fmt(text, "") == (1.0 if loose.match(text) else 0.0), repr(text)
        assert r1_format_ok(text) == bool(full.fullmatch(text)), repr(text)


def test_last_boxed_brace_matching():
    assert last_boxed("\\boxed{a} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed {") is None
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed 5$") == "5"
