"""Answer extraction shared by the verifiers.

Every function here runs in linear time in the length of the text (no backtracking regular
expressions over the whole response), so a 100,000-character response or thousands of nested
braces cannot stall a worker.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)")


def braced_content(text: str, open_pos: int) -> str | None:
    """Content of the ``{...}`` group whose ``{`` is at ``open_pos`` (brace-matched), or None."""
    if open_pos >= len(text) or text[open_pos] != "{":
        return None
    depth = 0
    for i in range(open_pos, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_pos + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), brace-matched; None if absent.

    ``\\boxed 5`` (no brace) yields the text up to the next ``$`` or whitespace.
    """
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    start = idx + (len("\\boxed") if text.startswith("\\boxed", idx) else len("\\fbox"))
    if text.startswith(" ", start):
        rest = text[start + 1:]
        return re.split(r"[\s$]", rest, maxsplit=1)[0] or None
    return braced_content(text, start)


def unclosed_box(text: str) -> bool:
    """True if the last ``\\boxed{`` (or ``\\fbox{``) is never closed: a box with no answer."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return False
    start = idx + (len("\\boxed") if text.startswith("\\boxed", idx) else len("\\fbox"))
    return text.startswith("{", start) and braced_content(text, start) is None


def last_answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair, stripped; None if absent."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>"):end].strip()


def ordered_parts(text: str, parts: list[str], start: int = 0, end: int | None = None) -> bool:
    """True if ``parts`` occur in ``text[start:end]`` in this order without overlapping.

    Greedy earliest matching is optimal for this subsequence test, so the check is linear and
    equivalent to a ``.*``-separated regular expression such as ``a.*b.*c`` (DOTALL).
    """
    pos, end = start, len(text) if end is None else end
    for part in parts:
        found = text.find(part, pos, end)
        if found < 0:
            return False
        pos = found + len(part)
    return True


def r1_format_ok(text: str) -> bool:
    """The seed's R1 format test used by ``base_acc`` and ``math_verify_reward``.

    Equivalent to ``re.fullmatch(r"<think>.*</think>.*<answer>.*\\\\boxed\\{.*\\}.*</answer>", text, DOTALL)``.
    """
    head, tail = "<think>", "</answer>"
    if not (text.startswith(head) and text.endswith(tail)) or len(text) < len(head) + len(tail):
        return False
    return ordered_parts(text, ["</think>", "<answer>", "\\boxed{", "}"], len(head), len(text) - len(tail))


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``1,234.5`` style thousands commas allowed), or None.

    The whole number, however long: the last 2,000 characters are scanned first (cheap on long
    responses), and the whole text when the number found there may have been cut by that window
    (e.g. the last 2,000 digits of a 100,000-digit number).
    """
    offset = max(0, len(text) - 2000)
    matches = list(_NUMBER.finditer(text, offset))
    if matches:
        pos = matches[-1].start()
        if pos == 0 or text[pos - 1] not in "0123456789,.-":
            return matches[-1].group().rstrip(",")
    if offset == 0:
        return matches[-1].group().rstrip(",") if matches else None
    matches = _NUMBER.findall(text)
    return matches[-1].rstrip(",") if matches else None


def gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` (GSM8K's answer marker), or None."""
    idx = text.rfind("####")
    if idx < 0:
        return None
    m = _GSM8K.match(text, idx)
    return m.group(1) if m else None


def to_fraction(text: str | None) -> Fraction | None:
    """Parse a plain number (``17``, ``-3.50``, ``1,000``, ``3/4``, ``$17``, ``17%`` -> 17) exactly."""
    if text is None:
        return None
    s = text.strip().strip("$").replace(",", "").replace("\\!", "").rstrip(".%").strip()
    if s.startswith("\\$"):
        s = s[2:]
    if not s or len(s) > 64:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(pred: str | None, label: str | None, rel_tol: float = 1e-6) -> bool:
    """Numeric equality of two plain-number strings: exact for rationals, else relative tolerance.

    Identical number strings are equal before any conversion, so numbers too long to convert
    (over 64 characters) still match themselves.
    """
    if pred is not None and label is not None and _PLAIN_NUMBER.fullmatch(pred.strip()) \
            and pred.strip().replace(",", "") == label.strip().replace(",", ""):
        return True
    a, b = to_fraction(pred), to_fraction(label)
    if a is None or b is None:
        return False
    if a == b:
        return True
    return abs(a - b) <= rel_tol * max(abs(a), abs(b))


def label_number(label: str) -> str | None:
    """The number a label stands for: the label itself, or its GSM8K ``#### N`` / ``\\boxed{N}``."""
    label = label.strip()
    if to_fraction(label) is not None:
        return label
    return gsm8k_answer(label) or last_boxed(label) or last_number(label)
