"""Math equivalence through Hugging Face's math-verify, and the ``math_equiv`` verifier.

math-verify (with sympy and latex2sympy2_extended) is imported lazily, on first use, so
``import posttrain`` stays cheap; the rule-reward workers import it once when they start.

math-verify guards its own parsing and comparison with ``signal.alarm``; that only works in the
main thread of a process. :func:`_mv_timeout` turns it off elsewhere (the rule-reward pool then
enforces the per-sample timeout by killing the worker).

Two rules keep hostile answers from being scored right by accident:

* an answer whose spelling equals the label's (:func:`same_answer`, after removing spacing and
  markup that never changes a value) is equal, before anything is parsed: a 100,000-digit number
  equals itself although no parser can read it;
* text nested deeper than :data:`MAX_NESTING` brackets is not parsed at all
  (:func:`parse_gold` / :func:`parse_pred` return nothing, so it scores as wrong). The LaTeX
  parser behind math-verify hits Python's recursion limit near depth 110, swallows the
  ``RecursionError`` and returns a *part* of the expression: ``\\frac{1}{\\frac{1}{…2…}}``
  120 deep (value 2) parsed as ``1/2``.
"""

from __future__ import annotations

import logging
import re
import threading
from functools import lru_cache

from posttrain.reward.verifiers import register_verifier
from posttrain.reward.verifiers.extract import (
    last_answer_tag, last_boxed, numbers_equal, to_fraction, unclosed_box,
)

_MV_TIMEOUT_S: int | None = 5

MAX_NESTING = 50
"""Deepest bracket nesting (``{}``, ``()``, ``[]`` together) handed to math-verify; deeper text
is not parsed (see the module docstring). Real answers stay far below it; the parser's own
limit is about twice as deep."""

FREE_TEXT_CHARS = 4000
"""math_equiv reads a response with no box and no ``<answer>`` tag from its last this-many
characters, starting at a whitespace so that no token is cut."""

_BRACKET = re.compile(r"[{}()\[\]]")
_WHITESPACE = re.compile(r"\s")
_BRACE = re.compile(r"[{}]")
_CMD_SPACE = re.compile(r"(\\[A-Za-z]+)\s+(?=[A-Za-z])")
_SPACING = re.compile(r"\\[,;:! ]|\\(?:left|right)(?![A-Za-z])|\\displaystyle(?![A-Za-z])|\s+")


def set_math_verify_timeout(seconds: int | None) -> None:
    """Seconds math-verify may spend on one parse / one comparison (its own SIGALRM guard)."""
    global _MV_TIMEOUT_S
    _MV_TIMEOUT_S = None if not seconds else max(1, int(seconds))


def _mv_timeout() -> int | None:
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _mv():
    import math_verify  # lazy: ~1 s; see the module docstring

    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "math_verify.metric",
                 "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # it logs whole inputs on failures
    return math_verify


def nesting_depth(text: str, stop: int | None = None) -> int:
    """Deepest nesting of ``{}``, ``()`` and ``[]`` (counted together) in ``text``; linear.

    Stops counting once ``stop`` is exceeded. Unmatched closing brackets are ignored.
    """
    depth = deepest = 0
    for m in _BRACKET.finditer(text):
        if m.group() in "{([":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop is not None and deepest > stop:
                    break
        elif depth:
            depth -= 1
    return deepest


def too_deep(text: str) -> bool:
    """True if ``text`` nests deeper than :data:`MAX_NESTING`: it is not given to math-verify."""
    return nesting_depth(text, MAX_NESTING) > MAX_NESTING


def canonical_answer(s: str) -> str:
    """``s`` without what never changes a value: whitespace (kept only where it separates a
    command such as ``\\sin`` from a letter), ``\\,`` ``\\;`` ``\\!`` spacing, ``\\left`` /
    ``\\right``, ``\\displaystyle``, ``$`` and a final ``.``; ``\\dfrac`` / ``\\tfrac`` read as
    ``\\frac``."""
    s = s.replace("\\$", "").replace("$", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _CMD_SPACE.sub("\\1\0", s)
    s = _SPACING.sub("", s).replace("\0", " ")
    return s.rstrip(".")


def same_answer(pred: str, label: str) -> bool:
    """True if ``pred`` and ``label`` are the same answer spelled the same way (after
    :func:`canonical_answer`); such answers are equal whatever a parser makes of them."""
    a = canonical_answer(pred)
    return bool(a) and a == canonical_answer(label)


@lru_cache(maxsize=4096)
def parse_gold(label: str) -> tuple:
    """math-verify parse of a ground-truth answer (``\\boxed{label}`` as LaTeX, else as text).

    Empty when the label nests deeper than :data:`MAX_NESTING` (not parsed: see module docstring).
    """
    mv = _mv()
    label = label.strip()
    if too_deep(label):
        return ()
    cfg = [mv.LatexExtractionConfig()]
    gold = mv.parse("\\boxed{" + label + "}", cfg, parsing_timeout=_mv_timeout())
    if not gold:
        gold = mv.parse(label, [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()],
                        parsing_timeout=_mv_timeout())
    return tuple(gold)


def parse_pred(text: str, latex_only: bool = False) -> list:
    """math-verify parse of a prediction: LaTeX (and, unless ``latex_only``, plain expressions).

    Empty when the text nests deeper than :data:`MAX_NESTING` (not parsed: see module docstring).
    """
    if too_deep(text):
        return []
    mv = _mv()
    cfg = [mv.LatexExtractionConfig()] if latex_only else [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    return mv.parse(text, cfg, parsing_timeout=_mv_timeout())


def verify_parsed(gold, pred) -> bool:
    """math-verify's equivalence of parsed gold and prediction (False when either is empty)."""
    if not gold or not pred:
        return False
    return bool(_mv().verify(list(gold), pred, timeout_seconds=_mv_timeout()))


def answers_equivalent(pred: str, ref: str, free_text: bool = False) -> bool:
    """Equivalence of an extracted answer with the label: the same spelling (:func:`same_answer`),
    else plain numbers exactly, else math-verify.

    ``pred`` is read as the content of a ``\\boxed{}``; with ``free_text`` (an ``<answer>`` tag
    that may hold a sentence such as "The answer is 17.") math-verify's extraction from the
    text is tried first. Answers nested deeper than :data:`MAX_NESTING` are equal only by spelling.
    """
    if same_answer(pred, ref):
        return True
    if to_fraction(pred) is not None and to_fraction(ref) is not None:
        return numbers_equal(pred, ref)
    gold = parse_gold(ref)
    if free_text and verify_parsed(gold, not_a_piece(parse_pred(pred), pred)):
        return True
    boxed = parse_pred("\\boxed{" + pred + "}", latex_only=True)
    if not boxed:  # not LaTeX: a plain expression, but only one that is the whole answer
        plain = parse_pred(pred)
        boxed = plain if len(plain) > 1 and canonical_answer(str(plain[1])) == canonical_answer(pred) else []
    return verify_parsed(gold, boxed)


def not_a_piece(parsed: list, text: str) -> list:
    """``parsed`` (math-verify's extraction from free ``text``), or [] when what it extracted
    occurs in ``text`` only inside ``{...}``: a piece of a larger expression, e.g. the innermost
    ``\\frac{1}{2}`` of ``\\frac{1}{\\frac{1}{2}}``, which math-verify finds when it cannot read
    the whole (LaTeX without ``$`` delimiters)."""
    if len(parsed) < 2 or not isinstance(parsed[1], str) or not parsed[1]:
        return parsed
    part = parsed[1]
    hits = [m.start() for m in re.finditer(re.escape(part), text)]
    if not hits:
        return parsed  # normalised by math-verify: cannot tell, keep it
    depth, hit = 0, 0
    for m in _BRACE.finditer(text):
        while hit < len(hits) and hits[hit] < m.start():
            if depth == 0:
                return parsed
            hit += 1
        depth = depth + 1 if m.group() == "{" else max(0, depth - 1)
    return parsed if hit < len(hits) and depth == 0 else []


@register_verifier("math_equiv")
def math_equiv(response: str, label: str, **kw) -> float:
    """1.0 if the response's final answer is mathematically equal to the label, else 0.0.

    Final answer: the last ``\\boxed{...}``; else the last ``<answer>...</answer>``; else what
    math-verify extracts from the end of the response ("the answer is 17.", "$x = 3$", ...).
    An answer spelled as the label is equal; plain numbers compare exactly (``17.0 == 17``,
    ``1,000 == 1000``); everything else goes through math-verify. No format is required.

    Scored 0.0 (no answer): a last ``\\boxed{`` that is never closed, and a response with no box
    and no tag whose last :data:`FREE_TEXT_CHARS` characters are one cut token (a truncated huge
    expression must not match by its last few characters). Answers nested deeper than
    :data:`MAX_NESTING` brackets are equal only when spelled as the label.
    """
    if not label or not label.strip():
        return 0.0
    boxed = last_boxed(response)
    if boxed is not None:
        return 1.0 if boxed.strip() and answers_equivalent(boxed, label) else 0.0
    if unclosed_box(response):
        return 0.0
    tagged = last_answer_tag(response)
    if tagged is not None:
        return 1.0 if tagged and answers_equivalent(tagged, label, free_text=True) else 0.0
    if same_answer(response, label):
        return 1.0
    tail = _free_text_tail(response)
    if not tail:
        return 0.0
    return 1.0 if verify_parsed(parse_gold(label), not_a_piece(parse_pred(tail), tail)) else 0.0


def _free_text_tail(text: str) -> str:
    """The last :data:`FREE_TEXT_CHARS` characters of ``text``, from a whitespace on, so that no
    token is cut ("" when that window holds a single cut token)."""
    if len(text) <= FREE_TEXT_CHARS:
        return text
    start = len(text) - FREE_TEXT_CHARS
    if text[start - 1].isspace():
        return text[start:]
    m = _WHITESPACE.search(text, start)
    return text[m.end():] if m else ""
