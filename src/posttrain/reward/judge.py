"""Judge rewards: a causal LM (LLM-as-judge, a generative reward model) rates each response.

For every (prompt, response, reference) of a reward read, the judge reads the template filled in
(:mod:`posttrain.reward.judge_template`; wrapped in the judge tokenizer's chat template when it has
one), generates at most ``max_tokens`` tokens (greedy at ``temperature`` 0, else sampled with a fixed
seed), and :mod:`posttrain.reward.judge_parse` reads the score, normalised to [0, 1]. All the read's
judgements are one ``generate`` call of the judge's engine (split only where the engine's
``max_num_seqs`` is smaller than the read).

* a text without a score (or with one outside ``[0, max_score]``) scores ``failure_value`` and counts
  in ``judge/parse_failures`` (the share of the iteration's judgements);
* the whole read has ``timeout_s`` seconds: the engine stops its decode then, and every judgement not
  finished scores ``failure_value`` and counts in ``judge/timeouts``;
* ``judge/latency_s`` is the mean time of one read's judging, ``judge/score/{mean,max,min}`` the
  judge's scores (failures included).

The engine is any engine with the native engine's ``generate(..., stop_when=, stop_every=)``: a
:class:`~posttrain.rollout.native.NativeEngine` on the judge's own model, or on the policy's model
(the self-judge, which rates with this step's weights).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from posttrain.reward.judge_parse import parse_score
from posttrain.reward.judge_template import fill
from posttrain.rollout.base import SamplingParams


@dataclass
class JudgeResult:
    """Per response: its score (normalised, or the failure value) and the judge's text (None where
    it timed out); the metrics of the read."""

    scores: list[float]
    texts: list[str | None]
    metrics: dict[str, Any] = field(default_factory=dict)


class JudgeGenerator:
    """Judge prompts (text) in, the judge's replies (text, None where the timeout cut them) out. A
    prompt that encodes to no token (a template of ``{response}`` alone, and an empty response) gets
    the empty reply, which no parser reads: a parse failure."""

    def __init__(self, engine, tokenizer, *, max_tokens: int, timeout_s: float, temperature: float = 0.0,
                 seed: int = 0, stop_token_ids: list[int] | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.timeout_s = float(timeout_s)
        self.sampling = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), top_k=-1,
                                       top_p=1.0, seed=int(seed))
        self.stop_token_ids = list(stop_token_ids or [])

    def encode(self, text: str) -> list[int]:
        """The judge's prompt ids: ``text`` as a user turn of the chat template, or plain."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    def generate(self, texts: list[str]) -> tuple[list[str | None], float]:
        """The replies to ``texts`` and the seconds they took, in as few engine calls as fit."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        ids = [self.encode(t) for t in texts]
        asked = [i for i, row in enumerate(ids) if row]  # an empty judge prompt gets the empty reply
        width = max(1, int(getattr(self.engine, "max_num_seqs", len(asked)) or len(asked)))
        replies: list[str | None] = [""] * len(ids)
        for lo in range(0, len(asked), width):
            rows = asked[lo:lo + width]
            for i, reply in zip(rows, self._chunk([ids[i] for i in rows], rows, deadline)):
                replies[i] = reply
        return replies, time.monotonic() - start

    def _chunk(self, ids: list[list[int]], keys: list[int], deadline: float) -> list[str | None]:
        if time.monotonic() >= deadline:
            return [None] * len(ids)
        cut: list[list[bool]] = []

        def past_deadline(finished: list[bool]) -> bool:
            if time.monotonic() < deadline:
                return False
            cut.append(list(finished))
            return True

        outs = self.engine.generate(ids, 1, self.sampling, self.stop_token_ids,
                                    prompt_keys=keys,
                                    stop_when=past_deadline, stop_every=1)
        done = cut[-1] if cut else [True] * len(ids)
        return [self.tokenizer.decode(o[0].token_ids, skip_special_tokens=True) if ok else None
                for o, ok in zip(outs, done)]


class JudgeScorer:
    """Score responses with a judge (module doc).

    Args:
        generator: the :class:`JudgeGenerator` (engine, tokenizer, sampling, timeout).
        template: the template text (fields ``{prompt}``, ``{response}``, ``{reference}``).
        parser: the compiled score regex (:func:`posttrain.reward.judge_parse.compile_parser`).
        max_score: the top of the template's scale (a score is divided by it).
        failure_value: the score of a judgement that fails to parse or times out.
    """

    def __init__(self, generator: JudgeGenerator, template: str, parser: re.Pattern, *, max_score: float = 10.0,
                 failure_value: float = 0.0):
        self.generator, self.template, self.parser = generator, template, parser
        self.max_score, self.failure_value = float(max_score), float(failure_value)

    def prompts(self, prompts: list[str], responses: list[str], references: list[str]) -> list[str]:
        return [fill(self.template, prompt=p, response=r, reference=ref)
                for p, r, ref in zip(prompts, responses, references)]

    def score(self, prompts: list[str], responses: list[str], references: list[str] | None = None) -> JudgeResult:
        """The judge's score of each (prompt, response, reference) text triple."""
        references = references if references is not None else [""] * len(prompts)
        if not prompts:
            return JudgeResult([], [])
        replies, seconds = self.generator.generate(self.prompts(prompts, responses, references))
        parsed = [None if text is None else parse_score(text, self.parser, self.max_score) for text in replies]
        scores = [self.failure_value if value is None else value for value in parsed]
        metrics = {"judge/parse_failures": [float(t is not None and v is None) for t, v in zip(replies, parsed)],
                   "judge/timeouts": [float(t is None) for t in replies], "judge/latency_s": seconds,
                   **{f"judge/score/{k}": scores for k in ("mean", "max", "min")}}
        return JudgeResult(scores, replies, metrics)
