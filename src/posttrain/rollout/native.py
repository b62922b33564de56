"""The native rollout engine: batched sampling on a Hugging Face causal LM with a KV cache.

It runs on the actor's own model object (colocated: no copy, so after an optimizer step the next
``generate`` sees the new weights) on any torch device. Per wave of prompts (see ``scheduling``):

1. prefill: the wave's unique prompts, left-padded to a common length, in chunks of at most
   ``max_num_batched_tokens`` tokens; logits are computed for the last position only;
2. expand: the prompt cache rows are index-selected ``n`` times (one copy per sample), so each
   prompt is prefilled once, not n times;
3. decode: one token per row per step with ``past_key_values``; rows that hit a stop token or
   ``max_tokens`` are dropped from the batch (cache rows index-selected away) once at least
   ``compact_fraction`` of the batch is finished, so finished rows cost nothing for long.

With ``static_cache`` (the default on CUDA) the decode runs on fixed shapes instead: the prompt
cache is copied into Hugging Face's ``StaticCache`` (capacity rounded up to a multiple of
``STATIC_BUCKET``), the attention mask is preallocated, and finished rows stay in the batch, so every
step is the same computation on the same buffers. ``cuda_graphs`` (the seed's ``enforce_eager:
false``) then compiles that step with ``torch.compile(mode="reduce-overhead")``, which replays it as a
CUDA graph, so Python's per-token overhead does not bound the decode. On a CPU the dynamic path is
faster (compaction saves compute) and is the default.

With ``dtype: bfloat16`` and fp32 training weights the engine samples from a bf16 copy of the actor
(weights and KV cache in bf16: half the memory traffic of autocast over fp32 weights, and no cast of
every weight at every decode step; on a CPU with AVX512-BF16 it decoded 1.3x faster than autocast),
refreshed from the actor whenever its parameters may have changed since the last call: an optimizer
stepped (a global step hook counts the steps; fused optimizers do not bump version counters), or
the parameters' version counters moved (``copy_``, ``load_state_dict``).

Sampling is keyed (:mod:`posttrain.rollout.keyed`): every row draws its token at each step with
the uniform of (seed, prompt key, sample index, token position), so the samples do not depend on
the waves, the compaction, the other prompts of the call or the number of workers that split them.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from posttrain.errors import ConfigError, DataError
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.keyed import random_seed, row_states, uniforms
from posttrain.rollout.kv_cache import concat_caches, new_cache, select_rows, to_static
from posttrain.rollout.sampling import sample_next
from posttrain.rollout.scheduling import plan_waves, prefill_chunks

# generate_config.dtype -> torch dtype used for the forward (autocast when weights are wider)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


_OPTIMIZER_STEPS: list[int] = []  # optimizer steps taken in this process, counted from the first call below


def _count_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


def optimizer_steps() -> int:
    """How many optimizer steps this process took since the first call (which starts counting)."""
    if not _OPTIMIZER_STEPS:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_count_step)
        _OPTIMIZER_STEPS.append(0)
    return _OPTIMIZER_STEPS[0]


STATIC_BUCKET = 64  # static-cache capacities are rounded up to this, so graphs are reused across calls


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"generate_config.dtype={name!r}: unknown; known: {sorted(DTYPES)}.")
    return DTYPES[name]


@dataclass
class WaveRows:
    """The random streams of a wave's sample rows: ``states`` [R] int64 (see ``keyed.row_states``)
    and the position of each row's first response token, ``offsets`` [R] int64."""

    states: torch.Tensor
    offsets: torch.Tensor
    caps: torch.Tensor | None = None  # the most new tokens of each row (default: sampling.max_tokens)
    stop_when: Any = None  # ends the wave when it returns True, asked every stop_every steps
    stop_every: int = 0


@dataclass
class RowKeys:
    """A call's seed and, per prompt, its key, first sample index and first token position."""

    seed: int
    prompt_keys: list[int]
    sample_offsets: list[int]
    position_offsets: list[int]

    @classmethod
    def build(cls, num_prompts: int, seed: int | None, prompt_keys, sample_offsets, position_offsets) -> "RowKeys":
        """Check the per-prompt lists (None: ``range(num_prompts)``, 0, 0) and fix the seed."""
        lists = {"prompt_keys": prompt_keys, "sample_offsets": sample_offsets, "position_offsets": position_offsets}
        for name, values in lists.items():
            if values is not None and len(values) != num_prompts:
                raise ConfigError(f"generate(): {name} has {len(values)} entries for {num_prompts} prompts; "
                                  "give one per prompt.")
        return cls(seed=random_seed() if seed is None else int(seed),
                   prompt_keys=list(range(num_prompts)) if prompt_keys is None else [int(k) for k in prompt_keys],
                   sample_offsets=[0] * num_prompts if sample_offsets is None else [int(s) for s in sample_offsets],
                   position_offsets=[0] * num_prompts if position_offsets is None else [int(p) for p in position_offsets])

    def rows(self, wave: list[tuple[int, int]], done: list[int], device) -> WaveRows:
        """The streams of a wave's rows: ``count`` rows for each ``(prompt, count)``, whose sample
        indices continue after the ``done`` samples that earlier waves drew for that prompt."""
        keys, samples, offsets = [], [], []
        for (prompt, count), first in zip(wave, done):
            for j in range(first, first + count):
                keys.append(self.prompt_keys[prompt])
                samples.append(self.sample_offsets[prompt] + j)
                offsets.append(self.position_offsets[prompt])
        return WaveRows(states=row_states(self.seed, keys, samples, device),
                        offsets=torch.tensor(offsets, dtype=torch.long, device=device))


@contextlib.contextmanager
def out_of_memory_hint(max_num_seqs: int) -> Iterator[None]:
    """Re-raise a device out-of-memory error with the keys that size the rollout's memory."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise torch.OutOfMemoryError(
            f"out of device memory during rollout ({max_num_seqs} rows at once): lower "
            "generate_config.max_num_seqs (fewer rows decoded together) or "
            "generate_config.gpu_memory_utilization (vLLM's share of the GPU), or free memory for the rollout "
            f"(rl_config.offload_reference, generate_config.offload_train_optimizer). {exc}") from exc


class NativeEngine:
    """``RolloutEngine`` on a PyTorch/HF causal LM. See the module docstring for the algorithm."""

    #: ``generate`` takes ``max_new_tokens`` and ``stop_when`` (partial rollout's rounds in one decode)
    supports_rounds = True

    def __init__(self, model: Any, *, pad_token_id: int, eos_token_ids: list[int] | int | None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, dtype: str = "float32",
                 compact_fraction: float = 0.125, static_cache: bool | None = None,
                 cuda_graphs: bool = False, sampling_copy: bool | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError("generate_config.max_num_seqs and max_num_batched_tokens must be >= 1 "
                              f"(got {max_num_seqs}, {max_num_batched_tokens}).")
        self.model = model
        self.pad_token_id = int(pad_token_id)
        eos = [] if eos_token_ids is None else ([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        self.eos_token_ids = [int(t) for t in eos]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.dtype = resolve_dtype(dtype)
        self.compact_fraction = compact_fraction
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ConfigError("generate_config.enforce_eager=false (CUDA graphs) needs a CUDA device; "
                              "remove the key on a CPU")
        self.static_cache = on_cuda if static_cache is None else bool(static_cache)
        self.cuda_graphs = bool(cuda_graphs)
        if self.cuda_graphs and not self.static_cache:
            raise ConfigError("CUDA graphs need the static KV cache (static_cache=True)")
        self.sampling_copy = self.dtype == torch.bfloat16 if sampling_copy is None else sampling_copy
        self._copy: Any = None  # the bf16 model that samples (sampling_copy), and the actor's version it holds
        self._copy_version: tuple[int, int] | None = None
        self._sampler = model  # the model the forward calls run on (set per call)
        # the static decode step, recorded as a CUDA graph on its first call per shape
        self._graph_step = torch.compile(self._forward, mode="reduce-overhead", dynamic=False) \
            if self.cuda_graphs else None
        # a PEFT (LoRA) model passes keyword arguments on to its base model: read the base's signature
        params = inspect.signature((model.get_base_model() if hasattr(model, "peft_config") else model).forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values())
        # transformers >= 5.2x names the cache argument `cache`; older ones `past_key_values`
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ public
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 stop_token_ids: list[int] | None = None, prompt_keys: list[int] | None = None,
                 sample_offsets: list[int] | None = None,
                 position_offsets: list[int] | None = None, max_new_tokens: list[int] | None = None,
                 stop_when=None, stop_every: int = 0) -> list[list[RolloutOutput]]:
        """Sample ``n`` responses per prompt; outer list = prompts (in order), inner = samples.

        Token ``t`` of sample ``j`` of prompt ``i`` is drawn with the uniform keyed by
        (``sampling.seed``, ``prompt_keys[i]``, ``sample_offsets[i] + j``,
        ``position_offsets[i] + t``) (defaults: ``i``, ``j``, ``t``), so a sample does not depend
        on the other prompts of the call. A continued response (partial rollout, multi-turn) passes
        the number of response tokens it already has as its position offset. ``sampling.seed=None``
        draws one seed per call from torch's global generator.

        ``max_new_tokens[i]`` caps prompt ``i``'s samples below ``sampling.max_tokens``.
        ``stop_when(finished)``, asked every ``stop_every`` decode steps with one bool per sample row
        (prompt-major), ends the whole call when it returns True: rows not finished then return the
        tokens they have (finish reason ``"length"``). It needs the call to fit one wave
        (``max_num_seqs`` rows).
        """
        if n < 1:
            raise ConfigError(f"rl_config.n_samples_per_prompt={n}: must be >= 1.")
        if (stop_when is not None or max_new_tokens is not None) and not self.supports_rounds:
            raise ConfigError(f"{type(self).__name__}.generate does not take max_new_tokens or stop_when")
        for i, prompt in enumerate(prompt_token_ids):
            if len(prompt) == 0:
                raise DataError(f"prompt {i} is empty: every prompt needs at least one token.")
        results: list[list[RolloutOutput]] = [[] for _ in prompt_token_ids]
        if not prompt_token_ids:
            return results
        keys = RowKeys.build(len(prompt_token_ids), sampling.seed, prompt_keys, sample_offsets, position_offsets)
        stops = torch.tensor(sorted(set(self.eos_token_ids) | set(stop_token_ids or [])),
                             dtype=torch.long, device=self.device)
        waves = plan_waves([len(p) for p in prompt_token_ids], n, self.max_num_seqs)
        if stop_when is not None and (len(waves) > 1 or stop_every < 1):
            raise ConfigError(f"generate(stop_when=...) needs one wave (at most max_num_seqs={self.max_num_seqs} "
                              f"rows, got {len(prompt_token_ids) * n}) and stop_every >= 1 (got {stop_every})")
        with self._generation_mode(), out_of_memory_hint(self.max_num_seqs):
            for wave in waves:
                prompts = [prompt_token_ids[i] for i, _ in wave]
                counts = [c for _, c in wave]
                rows = keys.rows(wave, [len(results[i]) for i, _ in wave], self.device)
                if max_new_tokens is not None:  # per-row caps (the default path checks none)
                    rows.caps = torch.tensor([min(int(max_new_tokens[i]), sampling.max_tokens)
                                              for i, c in wave for _ in range(c)], device=self.device)
                rows.stop_when, rows.stop_every = stop_when, stop_every
                for (idx, _), outs in zip(wave, self._run_wave(prompts, counts, sampling, stops, rows)):
                    results[idx].extend(outs)
        return results

    @property
    def device(self) -> torch.device:
        param = next(iter(self.model.parameters()), None)
        return param.device if param is not None else torch.device("cpu")

    # ------------------------------------------------------------------ internals
    def _sampling_model(self) -> Any:
        """The actor itself, or (``sampling_copy``) its copy in ``dtype``, refreshed when the actor's
        parameters may have changed since the copy was taken (see the module docstring)."""
        params = list(self.model.parameters())
        eligible = (params and not hasattr(self.model, "peft_config") and params[0].dtype != self.dtype
                    and not any(type(p).__name__ == "DTensor" for p in params[:1]))
        if not self.sampling_copy or not eligible:
            return self.model
        version = (sum(p._version for p in params), optimizer_steps())
        if self._copy is None:
            import copy

            self._copy = copy.deepcopy(self.model).to(self.dtype).eval()
            self._copy.requires_grad_(False)
        elif version != self._copy_version:
            with torch.no_grad():
                for mine, theirs in zip(self._copy.parameters(), params):
                    mine.copy_(theirs)
        self._copy_version = version
        return self._copy

    @contextlib.contextmanager
    def _generation_mode(self) -> Iterator[None]:
        """eval mode + inference_mode + (autocast when the requested dtype is narrower than the weights)."""
        was_training = self.model.training
        self.model.eval()
        self._sampler = self._sampling_model()
        param = next(iter(self._sampler.parameters()), None)
        autocast = (param is not None and param.dtype.is_floating_point
                    and torch.finfo(self.dtype).bits < torch.finfo(param.dtype).bits)
        try:
            with torch.inference_mode():
                if autocast:
                    with torch.autocast(device_type=self.device.type, dtype=self.dtype):
                        yield
                else:
                    yield
        finally:
            self.model.train(was_training)
            self._sampler = self.model

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """One model call; returns the last-position logits [B, V] in float32."""
        kwargs = {"logits_to_keep": 1} if self._has_logits_to_keep else {}
        kwargs[self._cache_kwarg] = cache
        out = self._sampler(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **kwargs)
        return out.logits[:, -1, :].float()

    def _prefill(self, prompts: list[list[int]], capacity: int) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-pad and prefill each prompt once. Returns (cache, last logits [P, V], mask [P, L], lengths [P])."""
        length = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, length - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, length - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        caches, logits = [], []
        for rows in prefill_chunks(len(prompts), length, self.max_num_batched_tokens):
            cache = new_cache(self.model, capacity)
            sl = slice(rows.start, rows.stop)
            logits.append(self._forward(ids[sl], mask[sl], positions[sl], cache))
            caches.append(cache)
        lengths = mask.sum(-1)
        return concat_caches(caches), torch.cat(logits), mask, lengths

    def _run_wave(self, prompts: list[list[int]], counts: list[int], sampling: SamplingParams,
                  stops: torch.Tensor, rows: "WaveRows") -> list[list[RolloutOutput]]:
        """Prefill ``prompts`` once, expand to ``counts`` rows each, decode all rows to completion
        (row ``r`` draws from stream ``rows.states[r]`` at positions ``rows.offsets[r] + step``)."""
        device, max_tokens = self.device, sampling.max_tokens
        capacity = max(len(p) for p in prompts) + max_tokens
        cache, logits, prompt_mask, lengths = self._prefill(prompts, capacity)
        expand = torch.repeat_interleave(torch.arange(len(prompts), device=device),
                                         torch.tensor(counts, device=device))
        select_rows(cache, expand)
        logits, positions = logits.index_select(0, expand), lengths.index_select(0, expand)
        num_rows, prompt_len = expand.numel(), prompt_mask.shape[1]
        static = to_static(cache, self._sampler, -(-capacity // STATIC_BUCKET) * STATIC_BUCKET) \
            if self.static_cache else None
        # columns are switched on as tokens are fed (a static step attends over the whole capacity)
        mask = torch.zeros((num_rows, capacity if static is None else static.layers[0].max_cache_len),
                           dtype=torch.long, device=device)
        mask[:, :prompt_len] = prompt_mask.index_select(0, expand)
        cache = cache if static is None else static

        out_tokens = torch.full((num_rows, max_tokens), self.pad_token_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((num_rows, max_tokens), dtype=torch.float32, device=device)
        out_len = torch.full((num_rows,), max_tokens, dtype=torch.long, device=device)
        out_stop = torch.zeros((num_rows,), dtype=torch.bool, device=device)
        active = torch.arange(num_rows, device=device)  # original row id of each batch row
        finished = torch.zeros((num_rows,), dtype=torch.bool, device=device)

        for step in range(max_tokens):
            draws = None if sampling.greedy else uniforms(rows.states[active], rows.offsets[active] + step)
            tokens, logprobs = sample_next(logits, sampling, draws)
            live = active[~finished]
            out_tokens[live, step] = tokens[~finished]
            out_logprobs[live, step] = logprobs[~finished]
            hit = torch.isin(tokens, stops) & ~finished
            if bool(hit.any()):
                out_len[active[hit]] = step + 1
                out_stop[active[hit]] = True
                finished |= hit
            if rows.caps is not None:  # a row at its own cap ends ("length")
                capped = (rows.caps[active] <= step + 1) & ~finished
                if bool(capped.any()):
                    out_len[active[capped]] = step + 1
                    finished |= capped
            if step + 1 == max_tokens or bool(finished.all()):
                break
            if rows.stop_when is not None and (step + 1) % rows.stop_every == 0:
                done = torch.ones(num_rows, dtype=torch.bool, device=device)  # compacted rows are finished
                done[active] = finished
                if rows.stop_when(done.tolist()):
                    out_len[active[~finished]] = step + 1
                    break
            num_done = int(finished.sum())
            if static is None and num_done and num_done >= self.compact_fraction * finished.numel():
                keep = (~finished).nonzero().squeeze(1)
                select_rows(cache, keep)
                mask, positions, active = mask[keep], positions[keep], active[keep]
                tokens, finished = tokens[keep], finished[keep]
            tokens = tokens.masked_fill(finished, self.pad_token_id)
            cur_len = prompt_len + step + 1
            mask[:, cur_len - 1] = 1
            if static is None:
                logits = self._forward(tokens[:, None], mask[:, :cur_len], positions[:, None], cache)
            else:
                logits = self._static_step(tokens, mask, positions, cache)
            positions = positions + 1
        return self._collect(counts, out_tokens, out_logprobs, out_len, out_stop)

    def _static_step(self, tokens, mask, positions, cache) -> torch.Tensor:
        """One decode step on fixed shapes (replayed as a CUDA graph with ``cuda_graphs``)."""
        if self._graph_step is None:
            return self._forward(tokens[:, None], mask, positions[:, None], cache)
        torch.compiler.cudagraph_mark_step_begin()
        return self._graph_step(tokens[:, None], mask, positions[:, None], cache).clone()  # the graph reuses its output

    @staticmethod
    def _collect(counts, out_tokens, out_logprobs, out_len, out_stop) -> list[list[RolloutOutput]]:
        tokens, logprobs = out_tokens.tolist(), out_logprobs.tolist()
        lens, stopped = out_len.tolist(), out_stop.tolist()
        grouped, row = [], 0
        for count in counts:
            group = []
            for r in range(row, row + count):
                group.append(RolloutOutput(token_ids=tokens[r][:lens[r]], logprobs=logprobs[r][:lens[r]],
                                           finish_reason="stop" if stopped[r] else "length"))
            grouped.append(group)
            row += count
        return grouped
