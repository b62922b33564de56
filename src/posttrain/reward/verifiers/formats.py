"""The seed's format verifiers: ``format``, ``strict_format`` and ``step`` (seed_system.md 5.2).

All three are linear-time re-statements of the seed's regular expressions, so adversarial
responses (many repeated tags, 100,000 characters) cannot trigger regex backtracking.
"""

from __future__ import annotations

import re

from posttrain.reward.verifiers import register_verifier
from posttrain.reward.verifiers.extract import braced_content

_WS_ANSWER = re.compile(r"\s*<answer>")
_STEP = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def _occurrences(text: str, sub: str, start: int = 0):
    pos = text.find(sub, start)
    while pos >= 0:
        yield pos
        pos = text.find(sub, pos + 1)


def _r1_loose_match(text: str) -> bool:
    """``re.match(r"^<think>.*?</think>\\s*<answer>.*?</answer>$", text, DOTALL | MULTILINE)``."""
    if not text.startswith("<think>"):
        return False
    answer_start = None
    for p in _occurrences(text, "</think>", len("<think>")):
        m = _WS_ANSWER.match(text, p + len("</think>"))
        if m:
            answer_start = m.end()
            break
    if answer_start is None:
        return False
    for r in _occurrences(text, "</answer>", answer_start):
        after = r + len("</answer>")
        if after == len(text) or text[after] == "\n":
            return True
    return False


@register_verifier("format")
def format_reward(response: str, label: str, **kw) -> float:
    """1.0 if the response is ``<think>...</think> <answer>...</answer>`` (seed ``format``), else 0.0.

    As in the seed (MULTILINE ``$``), text after a newline that follows ``</answer>`` is allowed.
    """
    return 1.0 if _r1_loose_match(response) else 0.0


def _count_boxed(text: str) -> tuple[int, int]:
    """(number of complete ``\\boxed{...}`` groups, position of the first one or -1)."""
    count, first = 0, -1
    for pos in _occurrences(text, "\\boxed{"):
        if braced_content(text, pos + len("\\boxed")) is not None:
            count += 1
            first = pos if first < 0 else first
            if count > 1:
                break
    return count, first


@register_verifier("strict_format")
def strict_format_reward(response: str, label: str, **kw) -> float:
    """Seed ``strict_format``: 1.0 if valid, -0.5 otherwise.

    Valid: ``<think>``, ``</think>``, ``<answer>``, one ``\\boxed{...}`` and ``</answer>`` each
    occur exactly once, in this order, the text starts with ``<think>`` and ends with
    ``</answer>``.
    """
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    if any(response.count(t) != 1 for t in tags):
        return -0.5
    boxed_count, boxed_pos = _count_boxed(response)
    if boxed_count != 1:
        return -0.5
    t0, t1, a0, a1 = (response.find(t) for t in tags)
    ordered = t0 <= t1 <= a0 <= boxed_pos <= a1
    ends = response.startswith("<think>") and response.endswith("</answer>")
    return 1.0 if ordered and ends else -0.5


@register_verifier("step")
def reasoning_steps_reward(response: str, label: str, **kw) -> float:
    """Seed ``step``: ``min(1, n / 3)`` where n counts step markers (``Step k:``, ``First,`` ...)."""
    return min(1.0, len(_STEP.findall(response)) / 3)
