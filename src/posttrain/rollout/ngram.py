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

import torch


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


class Drafter:
    """Draft tokens for a wave's rows by n-gram lookup (:func:`propose`), while few
    enough rows are left that a step is bound by reading the weights rather than by compute: at most
    ``budget`` tokens fed per step, so ``min(tokens, budget // rows - 1)`` drafts per row."""

    def __init__(self, prompts: list[list[int]], groups: list[int], tokens: int, budget: int, pad: int = 0):
        self.prompts, self.groups, self.tokens, self.budget, self.pad = prompts, groups, tokens, budget, pad
        self.members: dict[int, list[int]] = {}
        for row, group in enumerate(groups):
            self.members.setdefault(group, []).append(row)

    def drafts(self, out_tokens: torch.Tensor, out_len: torch.Tensor, active: torch.Tensor,
               finished: torch.Tensor) -> torch.Tensor:
        """[A, k] drafts for the batch rows ``active`` (finished rows get padding; k = 0 when no
        row would speculate)."""
        live = int((~finished).sum())
        k = min(self.tokens, self.budget // max(live, 1) - 1)
        if k < 1:
            return out_tokens.new_zeros((active.numel(), 0))
        lengths = out_len.tolist()
        responses = [row[:n] for row, n in zip(out_tokens.tolist(), lengths)]
        drafts, found = [], False
        for row, done in zip(active.tolist(), finished.tolist()):
            draft: list[int] = []
            if not done:
                prompt = self.prompts[self.groups[row]]
                siblings = [prompt[-3:] + responses[other] for other in self.members[self.groups[row]] if other != row]
                draft = propose(prompt + responses[row], siblings, k)
                found |= bool(draft)
            drafts.append(draft + [self.pad] * (k - len(draft)))
        if not found:
            return out_tokens.new_zeros((active.numel(), 0))
        return torch.tensor(drafts, dtype=torch.long, device=out_tokens.device)
