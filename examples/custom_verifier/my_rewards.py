"""Example user verifiers for posttrain (see README.md in this folder).

Importing this module registers two verifiers:

* ``word_answer``: for short non-math answers ("Paris", "blue whale"). Takes the text after
  the last ``Answer:`` and compares it with the label, ignoring case, spaces and final
  punctuation: 1.0 correct, 0.1 for a wrong answer in the right format, 0.0 without ``Answer:``.
* ``short_and_correct``: ``math_equiv`` minus a length cost, using the ``prompt`` keyword
  argument that posttrain passes to verifiers that declare it.
"""

from __future__ import annotations

import re

from posttrain.reward.verifiers import VERIFIERS, register_verifier

_ANSWER = re.compile(r"(?i)answer\s*:\s*([^\n]*)")


def _canon(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".!?").split())


@register_verifier("word_answer")
def word_answer(response: str, label: str) -> float:
    matches = _ANSWER.findall(response[-1000:])
    if not matches:
        return 0.0
    return 1.0 if _canon(matches[-1]) == _canon(label) else 0.1


@register_verifier("short_and_correct")
def short_and_correct(response: str, label: str, prompt: str = "") -> float:
    correct = VERIFIERS.get("math_equiv").fn(response, label)
    budget = max(64, 4 * len(prompt))          # characters allowed before the cost starts
    cost = min(0.5, max(0, len(response) - budget) / (4 * budget))
    return correct - cost
