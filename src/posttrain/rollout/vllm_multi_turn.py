"""Multi-turn rollout with tools on the vLLM engine: token in, token out, each turn one vLLM request.

A conversation is the prompt, then model turns and tool turns, as on the native engine
(:mod:`posttrain.rollout.multi_turn`, whose turn logic, :class:`~posttrain.rollout.multi_turn.ToolTurns`,
this engine shares: the parser, the tool runner, the observation format and the limits)::

    prompt | model turn 1 ... </tool_call> | tool tokens | model turn 2 ... | ... | <|im_end|>

* Turns go in rounds. The first turn of every sample is one call of
  :meth:`VLLMEngine.generate <posttrain.rollout.vllm_engine.VLLMEngine.generate>` (each prompt's ``n``
  samples one request, seeded as plain rollout is: without tool calls this engine samples what the
  plain vLLM rollout samples). Every later turn of a row is a request whose prompt is the row's
  token ids so far (prompt + sampled tokens + tool tokens; nothing is decoded and re-encoded), with
  ``max_tokens`` what the turn and the row have left, seeded by (seed, prompt key, sample index,
  position). With ``generate_config.enable_prefix_caching`` vLLM reuses the KV of the conversation's
  full cache blocks; without it each turn re-prefills the conversation.
* A turn ends at a stop token (EOS, the template's end of turn) or at the parser's end tag
  (``</tool_call>``). vLLM runs without a tokenizer (``skip_tokenizer_init``), so it cannot stop at
  a string: the engine stops at the tag's *last token* and checks the turn's tail against the tag's
  tokens (the tokenizer's encoding of the tag, as the native engine does). When the tag is one token
  (Qwen2.5's ``</tool_call>``, an added token) that stop is exact; when it is several tokens and
  the last one appeared without the rest, the turn goes on in a new request from there (one more
  request, the same tokens: greedy is unchanged, sampling draws the rest from the continued
  request's stream).
* After a round, the tool calls of every row that ended its turn with calls run together in the
  tool runner's threads; their outputs are encoded once by the template's ``format_observation``
  (led by the end-of-turn token when the turn had paused at the tag) and appended with
  ``response_mask`` 0 and log-prob 0, and those rows go on in the next round. Rows wait for the
  slowest tool of their round (the native engine admits results at fixed decode steps instead).
* A row ends at a turn without a tool call, when its calls are used up, when its response reaches
  ``max_total_response_length`` or when prompt + response reaches ``max_model_len``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from posttrain.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from posttrain.rollout.keyed import random_seed
from posttrain.rollout.multi_turn import DECODE, WAIT, ConversationRow, ObservationFormat, ToolTurns, TurnLimits


class VLLMMultiTurnEngine(ToolTurns, RolloutEngine):
    """Tool turns on ``engine`` (a :class:`~posttrain.rollout.vllm_engine.VLLMEngine`); the other
    arguments are :class:`~posttrain.rollout.multi_turn.ToolTurns`'. Weight syncs and the probe are
    the engine's."""

    holds_weights = True  # vLLM's own copy (a LoRA wrapper syncs merged weights)

    def __init__(self, engine: Any, *, tokenizer: Any, runner: Any, parser: Any, observation: ObservationFormat,
                 limits: TurnLimits):
        self.engine = engine
        self._init_turns(tokenizer=tokenizer, runner=runner, parser=parser, observation=observation, limits=limits,
                         stops=engine.eos_token_ids)

    @property
    def max_num_seqs(self) -> int | None:
        return self.engine.max_num_seqs

    @property
    def probe(self) -> list[int]:
        return self.engine.probe

    def sync_weights(self, model: Any) -> int | None:
        return self.engine.sync_weights(model)

    def pop_metrics(self) -> dict[str, float]:
        """The engine's (``rollout/sync_probe_diff``) and the tools' (``timing/tool``, ``tool/*``)."""
        return {**self.engine.pop_metrics(), **ToolTurns.pop_metrics(self)}

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 stop_token_ids: list[int] | None = None,
                 prompt_keys: list[int] | None = None) -> list[list[RolloutOutput]]:
        """``n`` conversations per prompt (see the module docstring)."""
        sampling = replace(sampling, seed=sampling.seed if sampling.seed is not None else random_seed())
        keys = list(range(len(prompt_token_ids))) if prompt_keys is None else list(prompt_keys)
        self._stops = set(self.engine.eos_token_ids) | set(stop_token_ids or [])
        call_stops = sorted(self._stops | set(self.end_tag[-1:]))  # the tag's last token: see the docstring
        rows = [[ConversationRow(prompt_len=len(p), offset=0) for _ in range(n)] for p in prompt_token_ids]
        firsts = self.engine.generate(prompt_token_ids, n, sampling, call_stops, prompt_keys=keys,
                                      max_new_tokens=[self._turn_budget(group[0], sampling) for group in rows])
        live = [(i, j) for i, outs in enumerate(firsts) for j, out in enumerate(outs)
                if self._take_turn(rows[i][j], out, sampling)]
        while live:
            for i, j in live:
                if rows[i][j].status == WAIT:
                    self._admit(rows[i][j])
            live = [(i, j) for i, j in live if rows[i][j].status == DECODE]
            if not live:
                break
            convs = [rows[i][j] for i, j in live]
            outs = self.engine.generate([prompt_token_ids[i] + row.tokens for (i, _), row in zip(live, convs)], 1,
                                        sampling, call_stops, prompt_keys=[keys[i] for i, _ in live],
                                        sample_offsets=[j for _, j in live],
                                        position_offsets=[len(row.tokens) for row in convs],
                                        max_new_tokens=[self._turn_budget(row, sampling) for row in convs])
            live = [(i, j) for (i, j), out in zip(live, outs) if self._take_turn(rows[i][j], out[0], sampling)]
        return [[row.output() for row in group] for group in rows]

    def _turn_budget(self, row: ConversationRow, sampling: SamplingParams) -> int:
        """The tokens the row's current turn may still sample: what is left of ``max_tokens`` for
        the turn and of the row's room."""
        return max(1, min(sampling.max_tokens - (len(row.tokens) - row.turn_start), self._room(row)))

    def _take_turn(self, row: ConversationRow, out: RolloutOutput, sampling: SamplingParams) -> bool:
        """Append one request's tokens to ``row``; whether the row goes on (its tools started, or its
        turn continued after the tag's last token without the rest of the tag)."""
        row.append(out.token_ids, True, out.logprobs)
        row.feed = []  # the native engine's feed queue: unused here
        if out.token_ids and self._turn_ended(row, out.token_ids[-1]):
            return self._start_tools(row, step=0)
        if self._out_of_room(row) or len(row.tokens) - row.turn_start >= sampling.max_tokens \
                or out.finish_reason == "length":
            row.end("length")
            return False
        return True
