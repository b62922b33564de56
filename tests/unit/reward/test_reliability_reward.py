"""Regression tests for the reward defects of the reliability probe (issue 14, reward part).

R3  a deeply nested ``\\frac`` scored 1.0 for a wrong label (math-verify read a part of it);
R4  an unclosed ``\\boxed{1+1+…`` matched label ``1`` by its last token;
R5  identical huge numbers scored 0 (no parser could read them);
R11 a verifier's child processes outlived its timeout and the command.

Also: the new rules (same spelling first, no parsing of deep nesting, no partial extraction)
give the old scores on a few hundred ordinary answers.

This module is also imported by name in the pool's worker processes (``MODULES``): it registers
the ``t_r11_fork`` verifier there.
"""

import os
import random
import time
from fractions import Fraction
from pathlib import Path

import pytest

from posttrain.reward.pool import VerifierPool
from posttrain.reward.verifiers import VERIFIERS, register_verifier
from posttrain.reward.verifiers.extract import r1_format_ok

MODULES = ["test_reliability_reward"]


def score(name: str, response: str, label: str) -> float:
    return VERIFIERS.get(name).fn(response, label)


def nested_fraction(depth: int) -> str:
    """``\\frac{1}{\\frac{1}{…2…}}``: value 2 for an even depth, 1/2 for an odd one."""
    return "\\frac{1}{" * depth + "2" + "}" * depth


# ---------------------------------------------------------------- R3


@pytest.mark.parametrize("depth", [60, 120, 200])
def test_R3_deeply_nested_fraction_scores_wrong_label_0(depth):
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


def test_R3_a_piece_of_a_nested_fraction_is_not_the_answer():
    # math-verify finds a bare \frac{1}{2} inside LaTeX written without $ delimiters
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


# ---------------------------------------------------------------- R4


def test_R4_unclosed_box_scores_0():
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


def test_R4_last_number_is_the_last_number_of_the_response():
    # documented contract (docs/rewards.md, Limits): the last number token, whatever surrounds it
    assert score("last_number", "\\boxed{" + "1+" * 25000, "1") == 1.0
    assert score("last_number", "\\boxed{" + "1+" * 25000, "2") == 0.0


def test_answer_is_stays_linear_on_long_runs_of_spaces_and_colons():
    # one character class between "answer is" and the number: no nested quantifiers to backtrack
    assert score("answer_is", ("The answer is" + " :" * 100_000 + "x ") * 20, "1") == 0.0
    assert score("answer_is", "the answer is" + " " * 200_000 + "17", "17") == 1.0


# ---------------------------------------------------------------- R5


BIG = "".join(str((7 * i * i + 3) % 10) for i in range(100_000)).lstrip("0")


def test_R5_identical_huge_numbers_score_1():
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


def test_R5_different_huge_numbers_and_cut_numbers_score_0():
    other = BIG[:-1] + str((int(BIG[-1]) + 1) % 10)
    assert score("math_equiv", "\\boxed{" + BIG + "}", other) == 0.0
    assert score("last_number", "x = " + BIG, other) == 0.0
    # the last 2,000 digits of a 3,000-digit number are not the number
    assert score("last_number", "x = " + "1" * 3000, "1" * 2000) == 0.0
    assert score("last_number", "x = " + "1" * 3000, "1" * 3000) == 1.0


# ---------------------------------------------------------------- R11


@register_verifier("t_r11_fork")
def forking_verifier(response: str, label: str, **kw) -> float:
    """Forks a child that sleeps 60 s and writes its pid to the file ``label``; then sleeps
    60 s itself (``response == "hang"``) or returns 1.0."""
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(60)
        finally:
            os._exit(0)
    Path(label).write_text(str(pid))
    if response == "hang":
        time.sleep(60)
    return 1.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); it is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


def _read_pid(path: Path) -> int:
    deadline = time.monotonic() + 5
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.02)
    return int(path.read_text())


def test_R11_timed_out_verifier_children_are_killed(tmp_path):
    spec = VERIFIERS.get("t_r11_fork")
    hang, ret = tmp_path / "hang.pid", tmp_path / "return.pid"
    pids = []
    pool = VerifierPool([spec], num_workers=1, timeout=1.0, modules=MODULES)
    try:
        scores, status, errors = pool.run([(0, "hang", str(hang), {}), (0, "return", str(ret), {})])
        assert status == [1, 0] and scores == [0.0, 1.0], errors
        pids += [_read_pid(hang), _read_pid(ret)]
        # the timed-out item's child went with its worker's process group
        assert _gone_within(pids[0], 3.0), "the timed-out verifier's child survived its timeout"
        assert _alive(pids[1])  # a finished item's child lives until the pool closes...
        pool.close()
        assert _gone_within(pids[1], 3.0), "a verifier's child survived the pool's close()"  # ...not longer
    finally:
        pool.close()
        for pid in pids:  # never leave a sleeper behind, even when an assertion failed
            try:
                os.kill(pid, 9)
            except OSError:
                pass


# ---------------------------------------------------------------- ordinary answers keep their scores


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
