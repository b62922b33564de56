"""Answer extraction and a 0/1 reward for integer-answer tasks.

:func:`extract_answer` looks, in order, for the last ``\\boxed{...}``, the last
``<answer>...</answer>``, the last "answer is N", and (only when ``strict=False``) the last
integer in the text. :func:`score` is 1.0 when the extracted integer equals the reference.
This is a small measuring verifier for the scripts next to it (not part of the package); training
rewards come from the verifiers of ``posttrain.reward`` (``math_equiv``), see :func:`get_scorer`.
"""

from __future__ import annotations

import re
from typing import Callable

_INT = r"-?\d[\d,]*"
_PATTERNS = (
    re.compile(r"\\boxed\{\s*(" + _INT + r")\s*\}"),
    re.compile(r"<answer>\s*(" + _INT + r")\s*</answer>"),
    re.compile(r"answer is[:\s]*\$?\s*(" + _INT + r")", re.IGNORECASE),
)
_LAST_INT = re.compile(_INT)


def extract_answer(text: str, strict: bool = True) -> str | None:
    """The final integer answer in ``text`` as a string (commas removed), or None."""
    for pattern in _PATTERNS:
        found = pattern.findall(text)
        if found:
            return found[-1].replace(",", "")
    if strict:
        return None
    found = _LAST_INT.findall(text)
    return found[-1].replace(",", "") if found else None


def score(response: str, answer: str, strict: bool = True) -> float:
    """1.0 when the extracted answer equals ``answer`` as an integer, else 0.0."""
    got = extract_answer(response, strict=strict)
    if got is None:
        return 0.0
    try:
        return float(int(got) == int(answer))
    except ValueError:
        return 0.0


def get_scorer(name: str = "demo") -> Callable[[str, str], float]:
    """``demo`` / ``demo_lenient`` (this module) or any registered verifier of ``posttrain.reward``.

    Returns ``f(response, answer) -> float``.
    """
    if name == "demo":
        return lambda response, answer: score(response, answer, strict=True)
    if name == "demo_lenient":
        return lambda response, answer: score(response, answer, strict=False)
    from posttrain.reward.verifiers import VERIFIERS

    verifier = VERIFIERS.get(name).fn
    return lambda response, answer: float(_call_verifier(verifier, response, answer))


def _call_verifier(verifier, response: str, answer: str) -> float:
    """Call a reward verifier; tolerate a (score, info) return."""
    result = verifier(response, answer)
    return result[0] if isinstance(result, tuple) else result
