"""The seed's math accuracy verifiers (seed_system.md 5.2).

==================== ============================================================ ===================
name                 rule                                                          scores
==================== ============================================================ ===================
base_acc             R1 format (think/answer/boxed) and grade(last boxed, label)   1.0 / 0.0
acc                  seed extract_answer + math_equal                             1.0 / -0.5 / -1.0
math_17k_acc         grade(last boxed, label)                                      1.0 / 0.0
acc_for_ppo          same as math_17k_acc                                          1.0 / 0.0
math_verify_reward   R1 format, then math-verify on the whole response             1.0 / 0.0
==================== ============================================================ ===================

The extraction rules are the seed's. The comparisons are posttrain's: normalised string
equality, exact/tolerant numbers, then math-verify for symbolic equality (where the seed used
mathruler's grader or its own sympy grader). docs/rewards.md lists the differences. Text nested
deeper than :data:`~posttrain.reward.verifiers.equiv.MAX_NESTING` brackets is never parsed, so
such an answer is right only when its normalised string equals the label's.
"""

from __future__ import annotations

import math
import re

from posttrain.reward.verifiers import register_verifier
from posttrain.reward.verifiers.equiv import parse_gold, parse_pred, same_answer, verify_parsed
from posttrain.reward.verifiers.extract import braced_content, last_boxed, r1_format_ok
from posttrain.reward.verifiers.normalize import normalize_answer

_SEED_NUMBER = re.compile(r"-?\d*\.?\d+")
_END_MARKERS = ("</s>", "<|im_end|>", "<|endoftext|>")
_ANSWER_PHRASES = ("he answer is", "final answer is", "答案是")


def grade_answer(given: str | None, label: str) -> bool:
    """True if ``given`` equals ``label``: normalised strings, then math-verify equivalence."""
    if given is None or not label:
        return False
    a, b = normalize_answer(given), normalize_answer(label)
    if a and a.lower() == b.lower():
        return True
    num_a, num_b = _as_float(a), _as_float(b)
    if num_a is not None and num_b is not None:
        return math.isclose(num_a, num_b, rel_tol=1e-9, abs_tol=1e-12)
    return verify_parsed(parse_gold(label), parse_pred("\\boxed{" + given + "}", latex_only=True))


def _as_float(s: str) -> float | None:
    s = s.replace(",", "")
    if not s or len(s) > 40 or not _SEED_NUMBER.fullmatch(s.lstrip("+")):
        return None
    return float(s)


def seed_extract_answer(text: str) -> str:
    """The seed's ``extract_answer(pred, "math")`` (math_eval_toolkit/parser.py), re-implemented.

    Minerva "final answer is $X$. I hope" > last ``boxed{}`` > text after "the answer is" /
    "final answer is" / "答案是" > last number; then trimmed and normalised. "" when nothing.
    """
    text = text.replace("ки", "")
    if "final answer is $" in text and "$. I hope" in text:
        pred = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0].strip()
    elif "boxed" in text:
        tail = text[text.rfind("boxed") + len("boxed"):]
        pred = braced_content(tail, 0) if tail.startswith("{") else tail.split("$")[0]
        pred = pred or ""
    elif any(p in text for p in _ANSWER_PHRASES):
        phrase = next(p for p in _ANSWER_PHRASES if p in text)
        pred = text.split(phrase)[-1].strip()
    else:
        nums = _SEED_NUMBER.findall(text[-2000:].replace(",", ""))
        pred = nums[-1] if nums else ""
    pred = pred.replace("\n", "").strip().lstrip(":").rstrip(".").rstrip("/").strip()
    return normalize_answer(pred) if pred else ""


def math_equal(pred: str, ref: str) -> bool:
    """The seed's ``math_equal`` rules with math-verify as the symbolic step.

    Case-insensitive string equality; multiple-choice letters; numbers equal to ``ref``,
    ``ref/100`` or ``ref*100`` within ``rel_tol=1e-4``; otherwise math-verify equivalence.
    """
    if pred is None or ref is None:
        return False
    p, r = normalize_answer(str(pred)), normalize_answer(str(ref))
    if p.lower() == r.lower():
        return True
    if r.upper() in ("A", "B", "C", "D", "E") and p.strip("().: ").upper()[:1] == r.upper():
        return True
    num_p, num_r = _as_float(p.rstrip("%")), _as_float(r.rstrip("%"))
    if num_p is not None and num_r is not None:
        return any(math.isclose(num_p, cand, rel_tol=1e-4) for cand in (num_r, num_r / 100, num_r * 100))
    return verify_parsed(parse_gold(ref), parse_pred("\\boxed{" + pred + "}", latex_only=True))


def _assistant_part(text: str) -> str:
    idx = text.find("<|im_start|>assistant")
    if idx >= 0:
        text = text[idx + len("<|im_start|>assistant"):]
    cut = min((text.find(m) for m in _END_MARKERS if m in text), default=len(text))
    return text[:cut]


@register_verifier("acc")
def accuracy_reward(response: str, label: str, **kw) -> float:
    """Seed ``acc``: 1.0 correct; -0.5 extracted but wrong; -1.0 no ``boxed`` or nothing extracted.

    (A timeout or error scores 0.0; the rule-reward pool applies that.)
    """
    text = _assistant_part(response)
    if "boxed" not in text:
        return -1.0
    pred = seed_extract_answer(text)
    if not pred:
        return -1.0
    return 1.0 if math_equal(pred, label) else -0.5


@register_verifier("base_acc")
def base_model_accuracy_reward(response: str, label: str, **kw) -> float:
    """Seed ``base_acc``: R1 format (``<think>..</think>..<answer>..\\boxed{..}..</answer>``) and a
    correct last ``\\boxed{}`` give 1.0, anything else 0.0."""
    if not r1_format_ok(response):
        return 0.0
    return 1.0 if grade_answer(last_boxed(response), label) else 0.0


@register_verifier("math_17k_acc")
def math_17k_accuracy_reward(response: str, label: str, **kw) -> float:
    """Seed ``math_17k_acc``: 1.0 if the last ``\\boxed{}`` content equals the label, else 0.0."""
    return 1.0 if grade_answer(last_boxed(response), label) else 0.0


@register_verifier("acc_for_ppo")
def ppo_accuracy_reward(response: str, label: str, **kw) -> float:
    """Seed ``acc_for_ppo``: identical to ``math_17k_acc``."""
    return math_17k_accuracy_reward(response, label)


@register_verifier("math_verify_reward")
def math_verify_accuracy_reward(response: str, label: str, **kw) -> float:
    """Seed ``math_verify_reward``: R1 format required (else 0.0), then math-verify of the whole
    response (LaTeX and plain expressions) against ``\\boxed{label}``: 1.0 / 0.0. A last
    ``\\boxed{}`` spelled as the label scores 1.0 before parsing."""
    if not r1_format_ok(response):
        return 0.0
    boxed = last_boxed(response)
    if boxed is not None and same_answer(boxed, label):
        return 1.0  # spelled as the label: equal before parsing (a huge or deeply nested answer too)
    try:
        return 1.0 if verify_parsed(parse_gold(label), parse_pred(response)) else 0.0
    except Exception:
        return 0.0
