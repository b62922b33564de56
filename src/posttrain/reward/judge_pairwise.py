"""The pairwise judge: which of two responses to one prompt is better, asked in both orders.

A judge is biased towards a position (often the first response). :class:`PairwiseJudge` asks each
pair twice, ``(x, y)`` as (A, B) and then as (B, A), all in one engine call, and keeps a verdict only
when both orders agree (:func:`combine_orders`); a pair on which the judge contradicts itself, or
whose reply has no "Better: A/B", yields no preference.

:func:`label_pairs` turns two samples per prompt into DPO rows (``instruction``, ``chosen``,
``rejected``: the pairwise format of ``posttrain preprocess``, handler
``AlpacaStylePairwiseHandler``) and :func:`write_preference_jsonl` writes them, so a judge labels
preference data for ``stage: dpo`` from the policy's own samples (``posttrain judge-pairs``,
:mod:`posttrain.commands.judge_pairs`, samples two responses per prompt and writes the file).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.files import write_text_atomic
from posttrain.reward.judge import JudgeGenerator
from posttrain.reward.judge_parse import CHOICE, parse_choice
from posttrain.reward.judge_template import PAIRWISE_TEMPLATE, fill


def combine_orders(first: str | None, second: str | None) -> str | None:
    """The verdict on ``(x, y)`` from the reply with x as A (``first``) and the reply with x as B
    (``second``): ``"x"`` when x wins in both orders, ``"y"`` when y does, else None (a tie, a
    position bias, or a reply without a choice)."""
    if first == "A" and second == "B":
        return "x"
    if first == "B" and second == "A":
        return "y"
    return None


@dataclass
class PairwiseResult:
    """Per pair: ``"x"``, ``"y"`` or None (no agreement); the share of pairs decided and of replies
    without a choice."""

    verdicts: list[str | None]
    metrics: dict[str, float] = field(default_factory=dict)


class PairwiseJudge:
    """Compare pairs of responses with a judge's generator, in both orders (module doc); ``choice``
    reads "A" or "B" from a reply (default: the last "Better: X")."""

    def __init__(self, generator: JudgeGenerator, template: str = PAIRWISE_TEMPLATE, choice: re.Pattern = CHOICE):
        self.generator, self.template, self.choice = generator, template, choice

    def compare(self, prompts: list[str], xs: list[str], ys: list[str],
                references: list[str] | None = None) -> PairwiseResult:
        references = references if references is not None else [""] * len(prompts)
        texts = [fill(self.template, prompt=p, response_a=a, response_b=b, reference=ref)
                 for p, x, y, ref in zip(prompts, xs, ys, references) for a, b in ((x, y), (y, x))]
        replies, _ = self.generator.generate(texts)
        choices = [parse_choice(r, self.choice) if r is not None else None for r in replies]
        verdicts = [combine_orders(choices[2 * i], choices[2 * i + 1]) for i in range(len(prompts))]
        n = max(len(prompts), 1)
        return PairwiseResult(verdicts, {"judge/pairs_decided": sum(v is not None for v in verdicts) / n,
                                         "judge/parse_failures": sum(c is None for c in choices) / max(len(choices), 1)})


def label_pairs(prompts: list[str], xs: list[str], ys: list[str], verdicts: list[str | None]) -> list[dict]:
    """DPO rows (``instruction``, ``chosen``, ``rejected``) of the decided pairs, in order."""
    rows = []
    for prompt, x, y, verdict in zip(prompts, xs, ys, verdicts):
        if verdict is not None:
            chosen, rejected = (x, y) if verdict == "x" else (y, x)
            rows.append({"instruction": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def write_preference_jsonl(path: str | Path, rows: list[dict]) -> Path:
    """Write ``rows`` as JSON lines to ``path`` (atomically); the file ``posttrain preprocess`` reads
    with ``handler_name: AlpacaStylePairwiseHandler``."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    write_text_atomic(Path(path), text)
    return Path(path)
