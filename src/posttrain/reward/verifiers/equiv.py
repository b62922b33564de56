"""Math equivalence through Hugging Face's math-verify, and the ``math_equiv`` verifier.

math-verify (with sympy and latex2sympy2_extended) is imported lazily, on first use, so
``import posttrain`` stays cheap; the rule-reward workers import it once when they start.

math-verify guards its own parsing and comparison with ``signal.alarm``; that only works in the
main thread of a process. :func:`_mv_timeout` turns it off elsewhere (the rule-reward pool then
enforces the per-sample timeout by killing the worker).
"""

from __future__ import annotations

import logging
import threading
from functools import lru_cache

from posttrain.reward.verifiers import register_verifier
from posttrain.reward.verifiers.extract import last_answer_tag, last_boxed, numbers_equal, to_fraction

_MV_TIMEOUT_S: int | None = 5


def set_math_verify_timeout(seconds: int | None) -> None:
    """Seconds math-verify may spend on one parse / one comparison (its own SIGALRM guard)."""
    global _MV_TIMEOUT_S
    _MV_TIMEOUT_S = None if not seconds else max(1, int(seconds))


def _mv_timeout() -> int | None:
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _mv():
    import math_verify

    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.metric",
                 "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # it logs whole inputs on failures
    return math_verify


@lru_cache(maxsize=4096)
def parse_gold(label: str) -> tuple:
    """math-verify parse of a ground-truth answer (``\\boxed{label}`` as LaTeX, else as text)."""
    mv = _mv()
    label = label.strip()
    cfg = [mv.LatexExtractionConfig()]
    gold = mv.parse("\\boxed{" + label + "}", cfg, parsing_timeout=_mv_timeout())
    if not gold:
        gold = mv.parse(label, [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
                        parsing_timeout=_mv_timeout())
    return tuple(gold)


def parse_pred(text: str, latex_only: bool = False) -> list:
    """math-verify parse of a prediction: LaTeX (and, unless ``latex_only``, plain expressions)."""
    mv = _mv()
    cfg = [mv.LatexExtractionConfig()] if latex_only else [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    return mv.parse(text, cfg, parsing_timeout=_mv_timeout())


def verify_parsed(gold, pred) -> bool:
    """math-verify's equivalence of parsed gold and prediction (False when either is empty)."""
    if not gold or not pred:
        return False
    return bool(_mv().verify(list(gold), pred, timeout_seconds=_mv_timeout()))


def answers_equivalent(pred: str, ref: str, free_text: bool = False) -> bool:
    """Equivalence of an extracted answer with the label: plain numbers exactly, else math-verify.

    ``pred`` is read as the content of a ``\\boxed{}``; with ``free_text`` (an ``<answer>`` tag
    that may hold a sentence such as "The answer is 17.") math-verify's extraction from the
    text is tried first.
    """
    if to_fraction(pred) is not None and to_fraction(ref) is not None:
        return numbers_equal(pred, ref)
    gold = parse_gold(ref)
    if free_text and verify_parsed(gold, parse_pred(pred)):
        return True
    boxed = parse_pred("\\boxed{" + pred + "}", latex_only=True)
    return verify_parsed(gold, boxed or parse_pred(pred))


@register_verifier("math_equiv")
def math_equiv(response: str, label: str, **kw) -> float:
    """1.0 if the response's final answer is mathematically equal to the label, else 0.0.

    Final answer: the last ``\\boxed{...}``; else the last ``<answer>...</answer>``; else what
    math-verify extracts from the whole response ("the answer is 17.", "$x = 3$", ...). Plain
    numbers compare exactly (``17.0 == 17``, ``1,000 == 1000``); everything else goes through
    math-verify. No format is required.
    """
    if not label or not label.strip():
        return 0.0
    boxed = last_boxed(response)
    if boxed is not None:
        return 1.0 if boxed.strip() and answers_equivalent(boxed, label) else 0.0
    tagged = last_answer_tag(response)
    if tagged is not None:
        return 1.0 if tagged and answers_equivalent(tagged, label, free_text=True) else 0.0
    gold = parse_gold(label)
    return 1.0 if verify_parsed(gold, parse_pred(response[-4000:])) else 0.0
