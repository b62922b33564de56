"""Multi-turn rollout with tools on the native engine: token in, token out, the KV cache kept.

Each sample row is a conversation of model turns and tool turns::

    prompt | model turn 1 ... </tool_call> | tool tokens | model turn 2 ... | ... | <|im_end|>

* A model turn ends at a stop token (EOS, ``<|im_end|>``), at the parser's end tag
  (``</tool_call>``: the row *pauses*), or after ``max_tokens`` tokens (the row ends, "length").
* When a turn that ended at a stop token or the end tag holds tool calls and the row has calls left
  (``max_tool_calls``), the calls start in the tool runner's threads while the other rows go on
  decoding. Their results are *admitted* at the next step that is a multiple of ``admit_every``
  (all rows that paused since the last one together, so one wide forward step serves them all), or
  at once when no row is decoding: at a step fixed by the sampling alone, never in the order the
  tools finish, so a run is reproducible.
* Admission encodes the tool outputs once, wrapped by the chat template's ``format_observation``
  (led by the template's end-of-turn token when the turn had not closed itself), and feeds those
  tokens through the model on top of the row's KV cache: nothing is re-prefilled and nothing
  sampled is ever decoded and re-encoded. The training sequence is exactly the sampled tokens plus
  the tool tokens; ``response_mask`` is 1 on sampled tokens and 0 on tool tokens, whose logprob is 0.
* A row ends at a turn without a tool call, when its calls are used up, when its response reaches
  ``max_total_response_length`` or when prompt + response reaches ``max_model_len``.

Per-row lengths in one batch: the rows share the cache's columns. A decode step feeds each row's
new token; a row waiting for its tools feeds nothing (a masked column, a hole). Admitted tool
outputs go through a forward step over the admitted rows only, right-aligned in a chunk as wide as
the longest; the other rows get masked columns there. Positions are per row, so holes never shift a row's
positions. Token ``t`` of a row's response (tool tokens count) is drawn with the uniform keyed by
(seed, prompt key, sample index, t), as in the single-turn engine.

:meth:`MultiTurnEngine.generate_reprefill` is the same rollout done the usual way, re-prefilling the
whole conversation at every turn: the reference for tests and benchmarks/multiturn/.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.kv_cache import put_rows, select_rows, slab_only, take_rows
from posttrain.rollout.native import NativeEngine, WaveRows
from posttrain.rollout.sampling import sample_next
from posttrain.rollout.keyed import random_seed, uniforms

DECODE, WAIT, DONE = "decode", "wait", "done"
TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass(frozen=True)
class TurnLimits:
    """The seed's multi-turn keys (``rl_config``) and the admission delay.

    ``max_tool_response_length`` counts characters of one tool's output (0: no cap);
    ``truncate_side`` keeps the ``left`` part (the start), the ``right`` part (the end) or both ends
    (``middle``). ``max_parallel_calls`` caps the calls run per turn (0: all); the others get an
    error message. ``max_model_len`` 0: no cap. ``admit_every``: tool results join the batch at
    decode steps that are multiples of it (see the module docstring).
    """

    max_tool_calls: int
    max_total_response_length: int
    max_parallel_calls: int = 0
    max_tool_response_length: int = 0
    truncate_side: str = "left"
    max_model_len: int = 0
    admit_every: int = 8

    def __post_init__(self) -> None:
        if self.truncate_side not in TRUNCATE_SIDES:
            raise ConfigError(f"rl_config.tool_response_truncate_side={self.truncate_side!r}: must be one of "
                              f"{', '.join(TRUNCATE_SIDES)}.")

    def truncate(self, text: str) -> str:
        cap = self.max_tool_response_length
        if cap <= 0 or len(text) <= cap:
            return text
        if self.truncate_side == "left":
            return text[:cap] + "...(truncated)"
        if self.truncate_side == "right":
            return "(truncated)..." + text[-cap:]
        return text[:cap // 2] + "...(truncated)..." + text[len(text) - (cap - cap // 2):]


class ObservationFormat:
    """Tool outputs as tokens, encoded once: ``[end-of-turn] + separator + format_observation``."""

    def __init__(self, template: Any, tokenizer: Any):
        if not hasattr(template, "format_observation"):
            raise ConfigError("multi-turn rollout needs a templates.json template (actor_config.prompt_type), "
                              "whose format_observation wraps tool outputs; hf_chat_template has none. Use e.g. "
                              "qwen_retool.")
        self.template, self.tokenizer = template, tokenizer
        self.end_of_turn = template.eos_text(tokenizer)

    def text(self, outputs: list[str], closed: bool) -> str:
        t = self.template
        elements = t.format_separator.apply() + t.format_observation.apply("\n".join(outputs))
        return ("" if closed else self.end_of_turn) + t.to_text(elements, self.tokenizer)

    def encode(self, outputs: list[str], closed: bool) -> list[int]:
        return self.tokenizer.encode(self.text(outputs, closed), add_special_tokens=False)


@dataclass
class ToolStats:
    """Counters since the last :meth:`MultiTurnEngine.pop_metrics`."""

    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"timing/tool": self.wait_seconds, "tool/calls": float(self.calls), "tool/errors": float(self.errors),
                "tool/seconds_per_call": self.seconds / self.calls if self.calls else 0.0}


class _ColumnMask:
    """The rows' attention mask over the cache's columns [B, used], preallocated and doubled when
    full (a torch.cat per step would copy the whole mask every step)."""

    def __init__(self, mask: torch.Tensor):
        rows, self.used = mask.shape
        self.buf = mask.new_zeros((rows, 2 * self.used + 64))
        self.buf[:, :self.used] = mask

    def append(self, chunk: torch.Tensor) -> torch.Tensor:
        end = self.used + chunk.shape[1]
        if end > self.buf.shape[1]:
            grown = self.buf.new_zeros((self.buf.shape[0], 2 * end))
            grown[:, :self.used] = self.buf[:, :self.used]
            self.buf = grown
        self.buf[:, self.used:end] = chunk
        self.used = end
        return self.buf[:, :end]

    def select(self, index: torch.Tensor) -> None:
        self.buf = self.buf.index_select(0, index)


@dataclass
class ConversationRow:
    """One sample's conversation while it is generated."""

    prompt_len: int
    offset: int  # response tokens it had before this call (generate_reprefill's later turns)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)  # tokens the next forward step feeds
    turn_start: int = 0
    calls: int = 0
    status: str = DECODE
    finish: str = "length"
    closed: bool = True
    pending: Any = None
    admit_at: int = 0

    def append(self, tokens: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.mask += [1 if sampled else 0] * len(tokens)
        self.feed += tokens

    def end(self, finish: str) -> None:
        self.status, self.finish, self.feed = DONE, finish, []

    def output(self) -> RolloutOutput:
        return RolloutOutput(token_ids=self.tokens, logprobs=self.logprobs, finish_reason=self.finish,
                             response_mask=self.mask, tool_call_num=self.calls)


class ToolTurns:
    """The turn logic of a multi-turn engine, shared by the native one (:class:`MultiTurnEngine`) and
    the vLLM one (:class:`posttrain.rollout.vllm_multi_turn.VLLMMultiTurnEngine`): where a turn ends
    (a stop token, or the parser's end tag), starting its tool calls, admitting their outputs
    (:class:`ObservationFormat`) and the room a row has left (:class:`TurnLimits`).

    Args:
        tokenizer: decodes a finished turn for the parser (never re-encoded) and encodes tool output.
        runner: a :class:`posttrain.tools.runner.ToolRunner` over the registered tools.
        parser: a :class:`posttrain.tools.parsers.ToolParser` (``tool_parser_format``).
        observation: how tool outputs become tokens (:class:`ObservationFormat`).
        limits: :class:`TurnLimits`.
    """

    def _init_turns(self, *, tokenizer: Any, runner: Any, parser: Any, observation: ObservationFormat,
                    limits: TurnLimits, stops: list[int]) -> None:
        self.tokenizer, self.runner, self.parser = tokenizer, runner, parser
        self.observation, self.limits = observation, limits
        self.end_tag = tokenizer.encode(parser.end_tag, add_special_tokens=False)
        self.stats = ToolStats()
        self._one_turn = False
        self._stops: set[int] = set(stops)

    def pop_metrics(self) -> dict[str, float]:
        """``timing/tool`` (seconds the rollout waited on tools, not hidden behind decoding) and
        ``tool/{calls,errors,seconds_per_call}`` since the last call."""
        metrics, self.stats = self.stats.metrics(), ToolStats()
        return metrics

    def _turn_ended(self, row: ConversationRow, token: int) -> bool:
        """Whether the last token closed the turn (a stop token) or paused it (the end tag)."""
        tag = self.end_tag
        if token in self._stops:
            row.closed = True
            return True
        if tag and len(row.tokens) - row.turn_start >= len(tag) and row.tokens[-len(tag):] == tag:
            row.closed = False
            return True
        return False

    def _start_tools(self, row: ConversationRow, step: int) -> bool:
        """At a turn's end: start its tool calls (the row waits) or end the row. Whether it waits."""
        lim = self.limits
        if self._one_turn:  # generate_reprefill: one turn per call; the caller runs the tools
            row.end("stop")
            return False
        text = self.tokenizer.decode(row.tokens[row.turn_start:], skip_special_tokens=False)
        calls = self.parser.calls(text)
        left = lim.max_tool_calls - row.calls
        if not calls or left <= 0 or self._out_of_room(row):
            row.end("stop")
            return False
        run = min(left, lim.max_parallel_calls or left, len(calls))
        skipped = [replace(c, error=f"at most {run} tool calls run per turn here; this call was skipped")
                   for c in calls[run:]]
        row.pending = self.runner.submit(calls[:run] + skipped)
        row.calls += run
        row.status, row.admit_at = WAIT, step + 1
        return True

    def _admit(self, row: ConversationRow) -> None:
        """Append the tool outputs of a waiting row (waiting for them if needed) and resume it."""
        started = time.perf_counter()
        finished = row.pending.done()
        results = row.pending.results()
        if not finished:
            self.stats.wait_seconds += time.perf_counter() - started
        self.stats.calls += len(results)
        self.stats.errors += sum(not r.ok for r in results)
        self.stats.seconds += sum(r.seconds for r in results)
        tokens = self.observation.encode([self.limits.truncate(r.text) for r in results], row.closed)
        room = self._room(row)
        row.pending = None
        if len(tokens) >= room:
            row.append(tokens[:room], False)
            row.end("length")
            return
        row.append(tokens, False)
        row.turn_start, row.status = len(row.tokens), DECODE

    def _room(self, row: ConversationRow) -> int:
        """Response tokens the row may still add."""
        lim = self.limits
        used = row.offset + len(row.tokens)
        room = lim.max_total_response_length - used
        if lim.max_model_len:
            room = min(room, lim.max_model_len - row.prompt_len - len(row.tokens))
        return room

    def _out_of_room(self, row: ConversationRow) -> bool:
        return self._room(row) <= 0


class MultiTurnEngine(ToolTurns, NativeEngine):
    """The native engine with tool turns (see the module docstring); the turn logic is
    :class:`ToolTurns`'s (its args, beyond :class:`NativeEngine`'s)."""

    supports_rounds = False  # its per-row loop has its own limits (TurnLimits)
    supports_images = False  # its turns re-prefill text only

    def __init__(self, model: Any, *, tokenizer: Any, runner: Any, parser: Any, observation: ObservationFormat,
                 limits: TurnLimits, **engine_kwargs):
        super().__init__(model, **engine_kwargs)
        self._init_turns(tokenizer=tokenizer, runner=runner, parser=parser, observation=observation, limits=limits,
                         stops=self.eos_token_ids)

    # ------------------------------------------------------------------ the reference path
    def generate_reprefill(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                           stop_token_ids: list[int] | None = None,
                           prompt_keys: list[int] | None = None) -> list[list[RolloutOutput]]:
        """The same rollout with every turn generated from scratch: prompt + conversation so far
        re-prefilled each turn (no KV cache kept across turns). Same tokens, same keys."""
        seed = sampling.seed if sampling.seed is not None else random_seed()
        sampling = replace(sampling, seed=seed)
        keys = list(range(len(prompt_token_ids))) if prompt_keys is None else list(prompt_keys)
        rows = [(i, j, ConversationRow(prompt_len=len(p), offset=0)) for i, p in enumerate(prompt_token_ids) for j in range(n)]
        live = list(rows)
        while live:
            self._one_turn = True
            try:
                outs = self.generate([prompt_token_ids[i] + row.tokens for i, _, row in live], 1, sampling,
                                     stop_token_ids, prompt_keys=[keys[i] for i, _, _ in live],
                                     sample_offsets=[j for _, j, _ in live],
                                     position_offsets=[len(row.tokens) for _, _, row in live])
            finally:
                self._one_turn = False
            self._stops = set(self.eos_token_ids) | set(stop_token_ids or [])
            live = [entry for entry, out in zip(live, outs) if self._continue_turn(entry[2], out[0])]
        grouped: list[list[RolloutOutput]] = [[] for _ in prompt_token_ids]
        for i, _, row in rows:
            grouped[i].append(row.output())
        return grouped

    def _continue_turn(self, row: ConversationRow, turn: RolloutOutput) -> bool:
        """Add one generated turn (and, when it calls tools, their output) to ``row``; whether the
        row goes on to another turn."""
        row.turn_start = len(row.tokens)
        row.append(turn.token_ids, True, turn.logprobs)
        row.feed = []
        if turn.finish_reason == "length" or not self._turn_ended(row, turn.token_ids[-1]):
            row.end("length")
            return False
        if not self._start_tools(row, step=0):
            return False
        self._admit(row)
        row.feed = []
        return row.status != DONE

    # ------------------------------------------------------------------ the decode loop
    def _run_wave(self, prompts: list[list[int]], counts: list[int], sampling: SamplingParams,
                  stops: torch.Tensor, keys: WaveRows) -> list[list[RolloutOutput]]:
        device, lim = self.device, self.limits
        self._stops = set(stops.tolist())
        capacity = max(len(p) for p in prompts) + lim.max_total_response_length + 64
        cache, logits, mask, lengths = self._prefill(prompts, capacity)
        expand = torch.repeat_interleave(torch.arange(len(prompts), device=device), torch.tensor(counts, device=device))
        select_rows(cache, expand)
        logits, positions = logits.index_select(0, expand), lengths.index_select(0, expand)
        mask = _ColumnMask(mask.index_select(0, expand))
        offsets = keys.offsets.tolist()
        rows = [ConversationRow(prompt_len=len(prompts[p]), offset=offsets[r]) for r, p in enumerate(expand.tolist())]
        active = torch.arange(len(rows), device=device)  # the row id of each batch row
        step = 0
        while True:
            batch = [rows[a] for a in active.tolist()]
            decoding = [b for b, row in enumerate(batch) if row.status == DECODE]
            if decoding:
                sel = torch.tensor(decoding, device=device)
                ids = active[sel]
                done = torch.tensor([len(batch[b].tokens) for b in decoding], device=device)
                draws = None if sampling.greedy else uniforms(keys.states[ids], keys.offsets[ids] + done)
                tokens, logprobs = sample_next(logits.index_select(0, sel), sampling, draws)
                for b, token, logprob in zip(decoding, tokens.tolist(), logprobs.tolist()):
                    self._add_token(batch[b], token, logprob, sampling.max_tokens, step)
            boundary = all(row.status != DECODE for row in batch) or step % lim.admit_every == 0
            for row in batch:
                if row.status == WAIT and boundary and row.admit_at <= step:
                    self._admit(row)
            if all(row.status == DONE for row in batch):
                break
            num_done = sum(row.status == DONE for row in batch)
            if num_done and num_done >= self.compact_fraction * len(batch):
                keep = torch.tensor([b for b, row in enumerate(batch) if row.status != DONE], device=device)
                select_rows(cache, keep)
                mask.select(keep)
                positions, active = positions[keep], active[keep]
                batch = [batch[b] for b in keep.tolist()]
            logits, positions = self._feed(batch, cache, mask, positions)
            step += 1
        outputs = [row.output() for row in rows]
        grouped, start = [], 0
        for count in counts:
            grouped.append(outputs[start:start + count])
            start += count
        return grouped

    def _feed(self, batch: list[ConversationRow], cache, mask: _ColumnMask, positions: torch.Tensor):
        """Feed every batch row's ``feed`` through the model; returns the last logits [B, V] (rows
        that fed nothing get stale ones) and the rows' next positions.

        Rows with tool output to feed go first, in a forward step over those rows only (on a copy of
        their cache rows, written back), so an admission costs its rows, not the whole batch; then
        one decode step feeds the other rows' single tokens."""
        rows = list(range(len(batch)))
        wide = [b for b in rows if len(batch[b].feed) > 1] if slab_only(cache) else []
        logits = None
        if wide:
            index = torch.tensor(wide, device=self.device)
            ids, chunk_mask, chunk_pos = self._chunk([batch[b] for b in wide], positions.index_select(0, index))
            sub = take_rows(cache, index, ids.shape[1])
            full = torch.cat([mask.buf[:, :mask.used].index_select(0, index), chunk_mask], dim=1)
            wide_logits = self._forward(ids, full, chunk_pos, sub)
            put_rows(cache, sub, index)
            grown = torch.zeros((len(batch), ids.shape[1]), dtype=torch.long, device=self.device)
            grown[index] = chunk_mask
            mask.append(grown)
            positions = positions.index_add(0, index, chunk_mask.sum(-1))
            logits = torch.zeros((len(batch), wide_logits.shape[1]), device=self.device)
            logits[index] = wide_logits
        rest = [b for b in rows if batch[b].feed]
        if rest or logits is None:
            ids, chunk_mask, chunk_pos = self._chunk(batch, positions)
            step_logits = self._forward(ids, mask.append(chunk_mask), chunk_pos, cache)
            positions = positions + chunk_mask.sum(-1)
            if logits is None:
                logits = step_logits
            else:
                keep = torch.tensor(rest, device=self.device)
                logits[keep] = step_logits[keep]
        return logits, positions

    def _chunk(self, batch: list[ConversationRow], positions: torch.Tensor):
        """(ids, mask, positions) [B, W] of the rows' feeds, right-aligned; the feeds are consumed."""
        width = max(1, max(len(row.feed) for row in batch))
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        chunk_mask = torch.zeros((len(batch), width), dtype=torch.long)
        chunk_pos = positions.cpu()[:, None].repeat(1, width)
        for b, row in enumerate(batch):
            k = len(row.feed)
            if k:
                ids[b, width - k:] = torch.tensor(row.feed, dtype=torch.long)
                chunk_mask[b, width - k:] = 1
                chunk_pos[b, width - k:] += torch.arange(k)
                row.feed = []
        return ids.to(self.device), chunk_mask.to(self.device), chunk_pos.to(self.device)

    # ------------------------------------------------------------------ one row's turns
    def _add_token(self, row: ConversationRow, token: int, logprob: float, max_tokens: int, step: int) -> None:
        row.append([token], True, [logprob])
        if self._turn_ended(row, token):
            self._start_tools(row, step)
        elif self._out_of_room(row) or len(row.tokens) - row.turn_start >= max_tokens:
            row.end("length")
