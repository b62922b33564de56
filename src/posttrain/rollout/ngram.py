"""Draft tokens for speculative decoding by n-gram lookup (prompt lookup), with no draft model.

A row's draft is what followed the most recent earlier occurrence of its last ``n`` tokens
(``n = max_ngram`` down to 1), looked up first in the responses of its sibling samples (the other
samples of the same prompt, which at RL temperatures mostly say the same thing) and then in its own
prompt and response. The engine verifies the draft against its own keyed samples
(:mod:`posttrain.rollout.native`), so a draft only decides how many tokens one forward pass may
emit, never which tokens are emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


def _follow(source: Sequence[int], key: Sequence[int], k: int) -> list[int]:
    """The up to ``k`` tokens after the last occurrence of ``key`` in ``source`` that has at least
    one token after it ([] when there is none)."""
    n = len(key)
    last = key[-1]
    for i in range(len(source) - 2, n - 2, -1):
        if source[i] == last and list(source[i - n + 1:i + 1]) == list(key):
            return list(source[i + 1:i + 1 + k])
    return []


def propose(context: Sequence[int], siblings: Sequence[Sequence[int]], k: int, max_ngram: int = 3) -> list[int]:
    """Up to ``k`` draft tokens to follow ``context`` (a row's prompt + response so far), from
    ``siblings`` (other responses to the same prompt) and then ``context`` itself."""
    if k < 1 or not context:
        return []
    for n in range(min(max_ngram, len(context)), 0, -1):
        key = context[-n:]
        for source in (*siblings, context):
            draft = _follow(source, key, k)
            if draft:
                return draft
    return []
