"""DAPO-style verifiers: ``acc_for_dapo`` (Minerva "Answer:" matching) and ``retool_reward``.

``acc_for_dapo`` follows the seed's ``math_dapo.compute_score``: look at the last 300
characters, take the last ``Answer: ...`` line, normalise prediction and label with the
Minerva rules (Lewkowycz et al. 2022, appendix D) and compare the strings: 1.0 / -1.0.
"""

from __future__ import annotations

import re

from posttrain.reward.verifiers import register_verifier
from posttrain.reward.verifiers.extract import last_boxed

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds",
    "meters", "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}",
    "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_UNWRAP = tuple(re.compile(r"\\" + cmd + r"\{(.*?)\}") for cmd in ("text", "textbf", "overline", "boxed"))
_DOLLARS = re.compile(r"^[^$]*\$([^$]*)\$.*$", re.DOTALL)
_FRAC_SHORT = re.compile(r"frac([^{])(.)")
_SQRT_SHORT = re.compile(r"sqrt([^{])")


def normalize_final_answer(answer: str) -> str:
    """Minerva normalisation: after the last ``=``, substitutions, drop units and words,
    unwrap ``$..$``, ``\\text{}``, ``\\textbf{}``, ``\\overline{}``, ``\\boxed{}``, expand
    ``\\frac12`` / ``\\sqrt2``, drop ``$`` and thousands commas of integers."""
    answer = answer.split("=")[-1]
    for old, new in SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for expr in REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    answer = _DOLLARS.sub(r"$\1$", answer)
    for pattern in _UNWRAP:
        answer = pattern.sub(r"\1", answer)
    answer = _FRAC_SHORT.sub(r"frac{\1}{\2}", answer)
    answer = _SQRT_SHORT.sub(r"sqrt{\1}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def minerva_answer(response: str) -> str:
    """The normalised text of the last ``Answer: ...`` line in the last 300 characters, or ``[INVALID]``."""
    matches = _ANSWER_LINE.findall(response[-300:])
    return normalize_final_answer(matches[-1]) if matches else "[INVALID]"


@register_verifier("acc_for_dapo")
def accuracy_reward_for_dapo(response: str, label: str, **kw) -> float:
    """Seed ``acc_for_dapo``: 1.0 if the Minerva-normalised answer equals the label's, else -1.0."""
    return 1.0 if minerva_answer(response) == normalize_final_answer(label) else -1.0


@register_verifier("retool_reward")
def retool_reward(response: str, label: str, tool_call_num: int | None = None, **kw) -> float:
    """Seed ``retool_reward``: the last ``\\boxed{}`` of the last 100 characters must equal the
    label exactly (1.0, else -1.0); a wrong answer earns 0.1 per tool call, capped at 0."""
    pred = last_boxed(response[-300:][-100:])
    score = 1.0 if pred is not None and pred.strip() == label.strip() else -1.0
    if score < 0 and tool_call_num:
        score = min(0.0, score + 0.1 * float(tool_call_num))
    return score
