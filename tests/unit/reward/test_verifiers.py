"""Table-driven tests of every built-in verifier: each score value, positive and negative cases."""

import random
import re
from fractions import Fraction

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


# ---- hostile answers (the reliability probe, docs/reliability.md) ------------------------------------
# Regression tests for the reward defects of the probe (issue 14, reward part): a deeply nested
# ``\frac`` scored 1.0 for a wrong label (R3), an unclosed ``\boxed{1+1+...`` matched label ``1`` by
# its last token (R4), identical huge numbers scored 0 (R5). The new rules (same spelling first, no
# parsing of deep nesting, no partial extraction) give the old scores on a few hundred ordinary answers.
def score(name: str, response: str, label: str) -> float:
    return VERIFIERS.get(name).fn(response, label)


def nested_fraction(depth: int) -> str:
    """``\\frac{1}{\\frac{1}{…2…}}``: value 2 for an even depth, 1/2 for an odd one."""
    return "\\frac{1}{" * depth + "2" + "}" * depth


@pytest.mark.parametrize("depth", [60, 120, 200])
def test_deeply_nested_fraction_scores_a_wrong_label_0(depth):
    """Probe R3: a fraction nested 60 to 200 deep, scored against a wrong label and against its own spelling."""
    e = nested_fraction(depth)  # value 2
    boxed, r1 = "\\boxed{" + e + "}", "<think>x</think> <answer>\\boxed{" + e + "}</answer>"
    for wrong in ("0.5", "\\frac{1}{2}"):
        assert score("math_equiv", boxed, wrong) == 0.0
        assert score("acc", boxed, wrong) == -0.5           # extracted but not right
        assert score("math_17k_acc", boxed, wrong) == 0.0
        assert score("acc_for_ppo", boxed, wrong) == 0.0
        assert score("base_acc", r1, wrong) == 0.0
        assert score("math_verify_reward", r1, wrong) == 0.0
    # too deep to parse: not right for the true value either (scored as wrong, never as right)...
    assert score("math_equiv", boxed, "2") == 0.0
    # ...but an answer spelled exactly as the label is right before any parsing
    for name, response in (("math_equiv", boxed), ("acc", boxed), ("math_17k_acc", boxed),
                           ("acc_for_ppo", boxed), ("base_acc", r1), ("math_verify_reward", r1)):
        assert score(name, response, e) == 1.0, name


def test_a_piece_of_a_nested_fraction_is_not_the_answer():
    # math-verify finds a bare \frac{1}{2} inside LaTeX written without $ delimiters
    """Probe R3: math-verify read a bare fraction inside a nested one."""
    e = "\\frac{1}{\\frac{1}{2}}"  # value 2
    assert score("math_equiv", "<answer>" + e + "</answer>", "0.5") == 0.0
    assert score("math_equiv", "<answer>" + e + "</answer>", "2") == 1.0
    assert score("math_equiv", "So it is " + e, "0.5") == 0.0
    assert score("math_equiv", "So it is $" + e + "$", "2") == 1.0
    # at the nesting bound: the box is too deep to parse, its bare content is not read in pieces
    e50 = nested_fraction(50)
    assert score("math_equiv", "\\boxed{" + e50 + "}", "0.5") == 0.0


@pytest.mark.parametrize("depth", [1, 2, 7, 10])
def test_moderately_nested_fractions_are_still_compared(depth):
    value = "2" if depth % 2 == 0 else "\\frac{1}{2}"
    other = "\\frac{1}{2}" if depth % 2 == 0 else "2"
    boxed = "\\boxed{" + nested_fraction(depth) + "}"
    for name in ("math_equiv", "math_17k_acc"):
        assert score(name, boxed, value) == 1.0
        assert score(name, boxed, other) == 0.0


def test_unclosed_box_scores_0():
    """Probe R4: an unclosed box of 25,000 terms against label 1."""
    huge = "1+" * 25000  # 50 KB, as in the probe
    assert score("math_equiv", "\\boxed{" + huge, "1") == 0.0
    assert score("math_equiv", "The answer is $\\boxed{" + huge, "1") == 0.0
    assert score("math_equiv", "\\boxed{1+1+1", "1") == 0.0
    assert score("math_equiv", "\\boxed{5} but then \\boxed{5", "5") == 0.0  # the last box has no answer
    # no box: a huge expression cut by the free-text window does not match by its last token
    assert score("math_equiv", huge, "1") == 0.0
    assert score("math_equiv", huge + "1", "1") == 0.0
    # the seed verifiers already read an unclosed box as no answer
    assert score("acc", "\\boxed{" + huge, "1") == -1.0
    assert score("math_17k_acc", "\\boxed{" + huge, "1") == 0.0
    # ordinary responses around the rule keep their scores
    assert score("math_equiv", "\\boxed{5}", "5") == 1.0
    assert score("math_equiv", "\\boxed 5", "5") == 1.0
    assert score("math_equiv", "x " * 3000 + "so the answer is 17.", "17") == 1.0


def test_last_number_is_the_last_number_of_the_response():
    # documented contract (docs/rewards.md, Limits): the last number token, whatever surrounds it
    """Probe R4: ``last_number`` keeps its documented contract on the same input."""
    assert score("last_number", "\\boxed{" + "1+" * 25000, "1") == 1.0
    assert score("last_number", "\\boxed{" + "1+" * 25000, "2") == 0.0


def test_answer_is_stays_linear_on_long_runs_of_spaces_and_colons():
    # one character class between "answer is" and the number: no nested quantifiers to backtrack
    assert score("answer_is", ("The answer is" + " :" * 100_000 + "x ") * 20, "1") == 0.0
    assert score("answer_is", "the answer is" + " " * 200_000 + "17", "17") == 1.0


BIG = "".join(str((7 * i * i + 3) % 10) for i in range(100_000)).lstrip("0")


def test_identical_huge_numbers_score_1():
    """Probe R5: a 100,000-digit (and a 5,000-digit) number against itself."""
    big5k = BIG[:5000]
    for big in (BIG, big5k):
        assert score("math_equiv", big, big) == 1.0
        assert score("math_equiv", "\\boxed{" + big + "}", big) == 1.0
        assert score("math_equiv", "<answer>" + big + "</answer>", big) == 1.0
        assert score("acc", "\\boxed{" + big + "}", big) == 1.0
        assert score("math_17k_acc", "\\boxed{" + big + "}", big) == 1.0
        assert score("math_verify_reward", "<think>x</think><answer>\\boxed{" + big + "}</answer>", big) == 1.0
        assert score("last_number", "so x = " + big, big) == 1.0
        assert score("answer_number", "<answer>" + big + "</answer>", big) == 1.0
        assert score("gsm8k", "#### " + big, big) == 1.0
    tower = "2^{2^{40}}"
    for name in ("math_equiv", "acc", "math_17k_acc"):
        assert score(name, "\\boxed{" + tower + "}", tower) == 1.0
        assert score(name, "\\boxed{2^{2^{40}}}", "2^{ 2^{40} }") == 1.0  # spacing is not spelling


def test_different_huge_numbers_and_cut_numbers_score_0():
    """Probe R5: a huge number against one that differs in its last digit, or against its own tail."""
    other = BIG[:-1] + str((int(BIG[-1]) + 1) % 10)
    assert score("math_equiv", "\\boxed{" + BIG + "}", other) == 0.0
    assert score("last_number", "x = " + BIG, other) == 0.0
    # the last 2,000 digits of a 3,000-digit number are not the number
    assert score("last_number", "x = " + "1" * 3000, "1" * 2000) == 0.0
    assert score("last_number", "x = " + "1" * 3000, "1" * 3000) == 1.0


def _old_math_equiv(response: str, label: str) -> float:
    """math_equiv before the reliability fixes (frozen copy, math-verify called directly)."""
    import math_verify as mv

    from posttrain.reward.verifiers.extract import last_answer_tag, last_boxed, numbers_equal, to_fraction

    def gold_of(lab):
        lab = lab.strip()
        gold = mv.parse("\\boxed{" + lab + "}", [mv.LatexExtractionConfig()])
        return gold or mv.parse(lab, [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()])

    def pred_of(text, latex_only=False):
        cfg = [mv.LatexExtractionConfig()] if latex_only else [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
        return mv.parse(text, cfg)

    def verify(gold, pred):
        return bool(gold and pred and mv.verify(list(gold), pred))

    def equivalent(pred, ref, free_text=False):
        if to_fraction(pred) is not None and to_fraction(ref) is not None:
            return numbers_equal(pred, ref)
        gold = gold_of(ref)
        if free_text and verify(gold, pred_of(pred)):
            return True
        boxed = pred_of("\\boxed{" + pred + "}", latex_only=True)
        return verify(gold, boxed or pred_of(pred))

    if not label or not label.strip():
        return 0.0
    boxed = last_boxed(response)
    if boxed is not None:
        return 1.0 if boxed.strip() and equivalent(boxed, label) else 0.0
    tagged = last_answer_tag(response)
    if tagged is not None:
        return 1.0 if tagged and equivalent(tagged, label, free_text=True) else 0.0
    return 1.0 if verify(gold_of(label), pred_of(response[-4000:])) else 0.0


def _old_math_verify_reward(response: str, label: str) -> float:
    import math_verify as mv

    if not r1_format_ok(response):
        return 0.0
    gold = mv.parse("\\boxed{" + label.strip() + "}", [mv.LatexExtractionConfig()]) or \
        mv.parse(label.strip(), [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()])
    pred = mv.parse(response, [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()])
    return 1.0 if gold and pred and mv.verify(list(gold), pred) else 0.0


def _normal_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(response, label) pairs as a policy writes them: right and wrong, several spellings."""
    rng = random.Random(seed)

    def answer() -> tuple[str, list[str]]:
        """A label and spellings of the same value (the first is the label itself)."""
        kind = rng.randrange(6)
        if kind == 0:
            k = rng.randint(-50, 500)
            return str(k), [str(k), f"{k}.0", f"{k:,}" if abs(k) >= 1000 else f"{k}.00"]
        if kind == 1:
            a, b = rng.randint(1, 9), rng.randint(2, 9)
            q = Fraction(a, b)
            spellings = [f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}", f"{a}/{b}",
                         f"\\frac{{{q.numerator}}}{{{q.denominator}}}"]
            if 10 ** 6 % q.denominator == 0:
                spellings.append(str(float(q)))
            return spellings[0], spellings
        if kind == 2:
            return "\\frac{1}{2}", ["\\frac{1}{2}", "0.5", "\\frac12", "1/2"]
        if kind == 3:
            c = rng.randint(1, 9)
            return f"x^2+{c}", [f"x^2+{c}", f"x^{{2}} + {c}", f"{c}+x^2", f"{c} + x^{{2}}"]
        if kind == 4:
            a, c = rng.randint(2, 9), rng.randint(1, 9)
            return f"{a}x+{c}", [f"{a}x+{c}", f"{c}+{a}x", f"{a}x + {c}"]
        k = rng.randint(2, 20)
        return f"\\sqrt{{{k}}}", [f"\\sqrt{{{k}}}", f"\\sqrt {k}", f"{k}^{{1/2}}"]

    def wrap(text: str) -> str:
        style = rng.randrange(5)
        return [f"The answer is {text}.", f"So the result is \\boxed{{{text}}}.",
                f"<answer>{text}</answer>", f"Therefore $x = {text}$", f"$\\boxed{{{text}}}$"][style]

    pairs = []
    for _ in range(n):
        label, spellings = answer()
        if rng.random() < 0.6:
            pred = rng.choice(spellings)
        else:
            pred = answer()[1][0]  # another answer (right only by chance)
        pairs.append((wrap(pred), label))
    return pairs


def test_new_rules_keep_the_scores_of_ordinary_answers():
    pairs = _normal_pairs(240)
    differ = [(r, lab, old, new) for r, lab in pairs
              if (old := _old_math_equiv(r, lab)) != (new := score("math_equiv", r, lab))]
    assert not differ, differ[:5]
    rights = sum(score("math_equiv", r, lab) for r, lab in pairs)
    assert 60 < rights < len(pairs) - 30  # both right and wrong answers were compared
    r1 = [(f"<think>work</think><answer>{r}</answer>", lab) for r, lab in pairs[:60]]
    differ = [(r, lab) for r, lab in r1
              if _old_math_verify_reward(r, lab) != score("math_verify_reward", r, lab)]
    assert not differ, differ[:5]


def test_demo_style_answers_keep_their_scores():
    # examples/demo: "The answer is N." scored with math_equiv on small integers
    for n in range(0, 60, 3):
        for label in (n, n + 1):
            response = f"Let me add. The answer is {n}."
            assert score("math_equiv", response, str(label)) == _old_math_equiv(response, str(label)) \
                == (1.0 if label == n else 0.0)
