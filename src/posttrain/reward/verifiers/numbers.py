"""Verifiers for plain numeric answers (small models, GSM8K, arithmetic demos).

Each extracts one number from the response and compares it with the label's number
exactly (``17 == 17.0 == 17.00``, ``1,000 == 1000``, ``3/4 == 0.75``): 1.0 if equal, else 0.0.
A label may be a bare number, a GSM8K solution ending in ``#### N`` or a ``\\boxed{N}``.
"""

from __future__ import annotations

import re

from posttrain.reward.verifiers import register_verifier
from posttrain.reward.verifiers.extract import (
    gsm8k_answer, label_number, last_answer_tag, last_number, numbers_equal,
)


#: "answer is" then a literal number: "The answer is 56.", "the answer is: **-3**", "answer is $1,200".
#: One character class between the words and the number, so a long run of spaces stays linear.
_ANSWER_IS = re.compile(r"answer is[\s:*$]*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


def _score(pred: str | None, label: str) -> float:
    if pred is None:
        return 0.0
    return 1.0 if numbers_equal(pred, label_number(label)) else 0.0


@register_verifier("answer_number")
def answer_number_reward(response: str, label: str, **kw) -> float:
    """1.0 if the last ``<answer>...</answer>`` holds the label's number (the tag's last number
    counts, so ``<answer>x = 17</answer>`` works), else 0.0."""
    content = last_answer_tag(response)
    return _score(last_number(content) if content is not None else None, label)


@register_verifier("answer_is")
def answer_is_reward(response: str, label: str, **kw) -> float:
    """1.0 if the last "answer is N" states the label's number as a literal number, else 0.0.

    Stricter than ``math_equiv``, which evaluates expressions: "The answer is 7 * 8." is 56 to it,
    and a policy rewarded by it learns to echo the question. Here that reads as 7, which is wrong.
    """
    matches = _ANSWER_IS.findall(response)
    return _score(matches[-1].rstrip(",") if matches else None, label)


@register_verifier("last_number")
def last_number_reward(response: str, label: str, **kw) -> float:
    """1.0 if the last number in the response equals the label's number, else 0.0."""
    return _score(last_number(response), label)


@register_verifier("gsm8k")
def gsm8k_reward(response: str, label: str, **kw) -> float:
    """1.0 if the number after the response's last ``####`` equals the label's number, else 0.0."""
    return _score(gsm8k_answer(response), label)
