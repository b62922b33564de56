"""The native rollout engine: batched sampling on a Hugging Face causal LM with a KV cache.

It runs on the actor's own model object (colocated: no copy, so after an optimizer step the next
``generate`` sees the new weights) on any torch device. Per wave of prompts (see ``scheduling``):

1. prefill: the wave's unique prompts, left-padded to a common length, in chunks of at most
   ``max_num_batched_tokens`` tokens; logits are computed for the last position only. A prefix that
   all of them start with (``scheduling.shared_prefix``: a system prompt, at least 16 tokens) runs
   once, in one row, and each chunk continues from copies of its cache;
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

With ``speculative_tokens`` (``generate_config.num_speculative_tokens``) a step also feeds each row
draft tokens, found by n-gram lookup in its sibling samples and its prompt (:mod:`posttrain.rollout.ngram`),
and samples a token after every fed position, each with the row's own keyed uniform for that token
position. The row emits its first sample and, while each draft token equals the sample before it,
the next: the emitted tokens are exactly those that one-token steps would have sampled from the same
logits, so speculation changes how many forward passes a rollout takes, never its tokens or their
distribution. The cache columns of rejected drafts are masked out and stay unused. Drafts are fed
only while at most ``speculative_budget`` tokens a step result (few rows left, where a step is bound
by reading the weights, so extra tokens cost little).

With ``dtype: bfloat16`` and fp32 training weights the engine samples from a bf16 copy of the actor
(weights and KV cache in bf16: half the memory traffic of autocast over fp32 weights, and no cast of
every weight at every decode step; on a CPU with AVX512-BF16 it decoded 1.3x faster than autocast),
refreshed from the actor whenever its parameters may have changed since the last call: an optimizer
stepped (a global step hook counts the steps; fused optimizers do not bump version counters), or
the parameters' version counters moved (``copy_``, ``load_state_dict``); a synchronous loop frees
it and the packs below for its update (:meth:`NativeEngine.drop_sampling_weights`).

On a CPU (``packed_weights``, measured unless ``$POSTTRAIN_ROLLOUT_PACKED`` pins it) the sampling
model's fp32 or bf16 linear layers multiply with weights prepacked into oneDNN's layout
(:mod:`posttrain.models.packed_linear`) instead of being reordered at every call; the packs are
rebuilt whenever the weights may have changed, by the same test as the bf16 copy's.

Sampling is keyed (:mod:`posttrain.rollout.keyed`): every row draws its token at each step with
the uniform of (seed, prompt key, sample index, token position), so the samples do not depend on
the waves, the compaction, the other prompts of the call or the number of workers that split them.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from posttrain.errors import ConfigError, DataError
from posttrain.models import cpu_attention, lean_forward
from posttrain.models.packed_linear import PackedLinears, resolve_packed
from posttrain.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from posttrain.rollout.images import ImageInputs, check_requests, prefill_inputs, vision_token_ids
from posttrain.rollout.keyed import random_seed, row_states, uniforms
from posttrain.rollout.kv_cache import (SlabLayer, concat_caches, new_cache, select_rows, slab_model, take_rows,
                                         to_static)
from posttrain.rollout.ngram import Drafter
from posttrain.rollout.sampling import sample_next
from posttrain.rollout.scheduling import model_len_caps, plan_waves, prefill_chunks, shared_prefix

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
    images: list[ImageInputs | None] | None = None  # per prompt of the wave (vision-language models)


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


def emitted_samples(samples: torch.Tensor, drafts: torch.Tensor, emitted: torch.Tensor, caps: torch.Tensor,
                    stops: torch.Tensor, finished: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a step's samples [B, 1 + k] each row emits, and which of those are stop tokens.

    Sample ``i`` follows the fed last token and drafts ``0..i-1``, so it is valid while every draft
    before it equals the sample at its position. A row also emits nothing after its first stop
    token, nothing past its cap (``emitted + i < caps``), and nothing once ``finished``."""
    index = torch.arange(samples.shape[1], device=samples.device)
    agree = torch.cat([torch.ones_like(samples[:, :1], dtype=torch.bool), drafts == samples[:, :-1]], 1)
    valid = agree.cumprod(1).bool() & (emitted[:, None] + index < caps[:, None]) & ~finished[:, None]
    is_stop = torch.isin(samples, stops) & valid
    valid &= (is_stop.cumsum(1) - is_stop.long()) == 0  # nothing after the first stop
    return valid, is_stop


def prompt_major(stop_when, wave, n: int):
    """``stop_when`` asked with the finished flags of a one-wave call in prompt-major order (the
    call's order); the wave holds its rows by prompt length (:func:`plan_waves`). None stays None."""
    if stop_when is None:
        return None
    order = [i * n + j for i, count in wave for j in range(count)]  # wave row -> its row in the call

    def asked(finished: list[bool]) -> bool:
        flags = [False] * len(order)
        for row, done in zip(order, finished):
            flags[row] = done
        return stop_when(flags)

    return asked


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


class NativeEngine(RolloutEngine):
    """``RolloutEngine`` on a PyTorch/HF causal LM. See the module docstring for the algorithm.

    It samples from the trained model object itself (a ``sampling_copy`` refreshes itself when the
    weights change), so ``sync_weights`` is the protocol's no-op."""

    #: ``generate`` takes ``max_new_tokens`` and ``stop_when`` (partial rollout's rounds in one decode)
    supports_rounds = True
    supports_images = True  # generate(images=...): prefill with a vision-language model's image inputs

    def __init__(self, model: Any, *, pad_token_id: int, eos_token_ids: list[int] | int | None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, dtype: str = "float32",
                 compact_fraction: float = 0.125, static_cache: bool | None = None,
                 cuda_graphs: bool = False, sampling_copy: bool | None = None, speculative_tokens: int = 0,
                 speculative_budget: int = 16, packed_weights: bool | None = None, max_model_len: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError("generate_config.max_num_seqs and max_num_batched_tokens must be >= 1 "
                              f"(got {max_num_seqs}, {max_num_batched_tokens}).")
        self.model = model
        cpu_attention.use_decode_sdpa(model)  # a CPU decode's one-token queries without a mask: pack_gqa
        self.pad_token_id = int(pad_token_id)
        eos = [] if eos_token_ids is None else ([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        self.eos_token_ids = [int(t) for t in eos]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len  # prompt + response at most (a response stops there, as vLLM's)
        self.dtype = resolve_dtype(dtype)
        self.compact_fraction = compact_fraction
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ConfigError("generate_config.enforce_eager=false (CUDA graphs) needs a CUDA device; "
                              "remove the key on a CPU")
        if speculative_tokens < 0 or speculative_budget < 2:
            raise ConfigError(f"speculative_tokens must be >= 0 and speculative_budget >= 2 (got {speculative_tokens}, "
                              f"{speculative_budget})")
        self.speculative_tokens, self.speculative_budget = int(speculative_tokens), int(speculative_budget)
        if static_cache is None:  # speculation runs on the dynamic cache (a static step feeds one token a row)
            static_cache = on_cuda and not self.speculative_tokens
        if static_cache and self.speculative_tokens:
            raise ConfigError("n-gram speculation feeds several tokens a row and needs the dynamic KV cache: "
                              "turn speculation off (generate_config.num_speculative_tokens: 0) or the static cache off")
        self.static_cache = bool(static_cache)
        self.cuda_graphs = bool(cuda_graphs)
        if self.cuda_graphs and not self.static_cache:
            raise ConfigError("CUDA graphs need the static KV cache (static_cache=True)")
        self.sampling_copy = self.dtype == torch.bfloat16 if sampling_copy is None else sampling_copy
        self._drafted = self._accepted = 0  # speculation: draft slots fed and accepted since pop_metrics
        self._copy: Any = None  # the bf16 model that samples (sampling_copy), and the actor's version it holds
        self._copy_version: tuple[int, int] | None = None
        self._sampler = model  # the model the forward calls run on (set per call)
        # the sampling model's CPU layers multiply with prepacked oneDNN weights (None: measured, packed_linear)
        self.packed_weights = resolve_packed(self.device.type, str(self.dtype).removeprefix("torch.")) \
            if packed_weights is None else bool(packed_weights)
        self._packs = PackedLinears()
        # with packed weights, a Llama-family model samples through models.lean_forward (stacked q/k/v, gate/up)
        self.use_lean_forward = self.packed_weights and lean_forward.enabled() and lean_forward.supported(model)
        self._lean_layers: list | None = None  # lean_forward.plan while a generate call runs on the packs
        # the static decode step, recorded as a CUDA graph on its first call per shape
        self._graph_step = torch.compile(self._forward, mode="reduce-overhead", dynamic=False) \
            if self.cuda_graphs else None
        # a PEFT (LoRA) model passes keyword arguments on to its base model: read the base's signature
        params = inspect.signature((model.get_base_model() if hasattr(model, "peft_config") else model).forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values())
        # transformers >= 5.2x names the cache argument `cache`; older ones `past_key_values`
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._never_sampled = vision_token_ids(model)  # a VLM's image pads etc.: masked out of every logits

    # ------------------------------------------------------------------ public
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 stop_token_ids: list[int] | None = None, prompt_keys: list[int] | None = None,
                 sample_offsets: list[int] | None = None,
                 position_offsets: list[int] | None = None, max_new_tokens: list[int] | None = None,
                 stop_when=None, stop_every: int = 0, images: list | None = None) -> list[list[RolloutOutput]]:
        """Sample ``n`` responses per prompt; outer list = prompts (in order), inner = samples.

        Token ``t`` of sample ``j`` of prompt ``i`` is drawn with the uniform keyed by
        (``sampling.seed``, ``prompt_keys[i]``, ``sample_offsets[i] + j``,
        ``position_offsets[i] + t``) (defaults: ``i``, ``j``, ``t``), so a sample does not depend
        on the other prompts of the call. A continued response (partial rollout, multi-turn) passes
        the number of response tokens it already has as its position offset. ``sampling.seed=None``
        draws one seed per call from torch's global generator.

        ``max_new_tokens[i]`` caps prompt ``i``'s samples below ``sampling.max_tokens``; so does the
        engine's ``max_model_len`` (a prompt and its response hold at most that many tokens, finish
        reason ``"length"`` there; a prompt of ``max_model_len`` tokens or more is refused, as vLLM does).
        ``stop_when(finished)``, asked every ``stop_every`` decode steps with one bool per sample row
        (prompt-major), ends the whole call when it returns True: rows not finished then return the
        tokens they have (finish reason ``"length"``). It needs the call to fit one wave
        (``max_num_seqs`` rows).

        ``images[i]`` (vision-language models, :mod:`posttrain.rollout.images`): prompt ``i``'s
        ``ImageInputs`` (or a dict of the image processor's ``pixel_values`` and ``image_grid_thw``),
        None for a text-only prompt; the prompt holds its image pads already expanded.
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
        if images is not None and not self.supports_images:
            raise ConfigError(f"{type(self).__name__}.generate does not take images; use the one-turn native engine")
        images = None if images is None else check_requests(self.model, prompt_token_ids, images)
        max_new_tokens = model_len_caps(self.max_model_len, prompt_token_ids, sampling.max_tokens, max_new_tokens)
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
                rows.stop_when, rows.stop_every = prompt_major(stop_when, wave, n), stop_every
                rows.images = None if images is None else [images[i] for i, _ in wave]
                for (idx, _), outs in zip(wave, self._run_wave(prompts, counts, sampling, stops, rows)):
                    results[idx].extend(outs)
        return results

    def pop_metrics(self) -> dict[str, float]:
        """Speculation (when on), since the last call: ``rollout/draft_tokens``, the draft tokens fed
        to unfinished rows (padding included), and ``rollout/draft_accept_rate``, the share of them
        accepted (each saves a forward pass of its row)."""
        if not self.speculative_tokens:
            return {}
        drafted, accepted, self._drafted, self._accepted = self._drafted, self._accepted, 0, 0
        return {"rollout/draft_tokens": float(drafted),
                "rollout/draft_accept_rate": accepted / drafted if drafted else 0.0}

    @property
    def device(self) -> torch.device:
        param = next(iter(self.model.parameters()), None)
        return param.device if param is not None else torch.device("cpu")

    # ------------------------------------------------------------------ internals
    @property
    def samples_from_copy(self) -> bool:
        """Whether ``generate`` samples from the bf16 sampling copy, not the actor's own weights
        (``sampling_copy``, weights of another dtype, no PEFT adapter merged in place, no FSDP2
        shards): then the actor's weights may leave the device once :meth:`prepare_sampling` has
        refreshed the copy (``generate_config.offload_train_param``)."""
        first = next(iter(self.model.parameters()), None)
        return bool(self.sampling_copy and first is not None and not hasattr(self.model, "peft_config")
                    and first.dtype != self.dtype and type(first).__name__ != "DTensor")

    def prepare_sampling(self) -> None:
        """The sampling copy brought up to date with the actor's weights now, so the next ``generate``
        reads only the copy (a no-op without one)."""
        if self.samples_from_copy:
            self._sampling_model()

    def drop_sampling_weights(self) -> int:
        """Free the packed weights and the bf16 sampling copy's (its modules stay) until the next ``generate``
        makes them again (a synchronous loop, before its update changes them); the number of tensors freed."""
        freed = len(self._packs.packs) + len(self._packs.fused)
        self._packs.clear()
        self._lean_layers, self._copy_version = None, None  # a copy is refreshed whole at the next call
        for param in self._copy.parameters() if self._copy is not None else ():
            freed += param.numel() > 0
            param.data = param.data.new_empty(0)
        return freed

    def _sampling_model(self) -> Any:
        """The actor itself, or (``sampling_copy``) its copy in ``dtype``, refreshed when the actor's
        parameters may have changed since the copy was taken (see the module docstring)."""
        if not self.samples_from_copy:
            return self.model
        params = list(self.model.parameters())
        version = self._weights_version()
        if self._copy is None:
            self._copy = copy.deepcopy(self.model).to(self.dtype).eval()
            self._copy.requires_grad_(False)
        elif version != self._copy_version:
            with torch.no_grad():
                for mine, theirs in zip(self._copy.parameters(), params):
                    if mine.shape != theirs.shape:  # freed for the update (drop_sampling_weights)
                        mine.data = mine.data.new_empty(theirs.shape)  # on the copy's device
                    mine.copy_(theirs)
        self._copy_version = version
        return self._copy

    def _weights_version(self) -> tuple[int, int]:
        """Changes whenever the actor's weights may have (see the module docstring)."""
        return sum(p._version for p in self.model.parameters()), optimizer_steps()

    def _packed(self, autocast: bool) -> contextlib.AbstractContextManager:
        """The sampling model's CPU layers on their prepacked weights, repacked when the weights may
        have changed (``packed_weights``, no autocast; a null context otherwise)."""
        if not self.packed_weights or autocast:
            return contextlib.nullcontext()
        fuse = lean_forward.fused_groups(self._sampler) if self.use_lean_forward else ()
        self._packs.refresh(self._sampler, (self._weights_version(), self._sampler is self.model), fuse)
        self._lean_layers = lean_forward.plan(self._sampler, self._packs.fused) if fuse else None
        return self._packs.installed()

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
            with torch.inference_mode(), self._packed(autocast):
                if autocast:
                    with torch.autocast(device_type=self.device.type, dtype=self.dtype):
                        yield
                else:
                    yield
        finally:
            self.model.train(was_training)
            self._sampler, self._lean_layers = self.model, None

    def _forward(self, input_ids, attention_mask, position_ids, cache, keep: int = 0, **extra) -> torch.Tensor:
        """One model call (``extra``: the prefill's image inputs); returns the last-position logits
        [B, V] in float32, or (``keep`` > 0) the last ``keep`` positions' [B, keep, V]."""
        if self._lean_layers is not None and not extra and isinstance(cache.layers[0], SlabLayer):
            out = lean_forward.forward(self._sampler, self._lean_layers, input_ids, attention_mask, position_ids, cache,
                                       max(keep, 1))
        else:
            kwargs = {"logits_to_keep": max(keep, 1)} if self._has_logits_to_keep else {}
            kwargs[self._cache_kwarg] = cache
            kwargs.update(extra)
            out = self._sampler(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=True, **kwargs).logits
        logits = out[:, -keep:, :].float() if keep else out[:, -1, :].float()
        if self._never_sampled:
            logits[..., self._never_sampled] = float("-inf")
        return logits

    def _prefill(self, prompts: list[list[int]], capacity: int,
                 images: list[ImageInputs | None] | None = None) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-pad and prefill each prompt once. Returns (cache, last logits [P, V], mask [P, L], the
        position of each prompt's next token [P]: its length, plus the model's rope delta with ``images``).

        A prefix that every prompt starts with (a system prompt, an instruction: ``shared_prefix``) is
        prefilled once, in one row, and each prompt's rest attends to a copy of its cache: the columns
        are then ``[prefix][left padding][rest]``."""
        shared = shared_prefix(prompts) if images is None and len(prompts) > 1 and slab_model(self.model) else 0
        rests = [p[shared:] for p in prompts]
        length = shared + max(len(r) for r in rests)
        ids = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        ids[:, :shared], mask[:, :shared] = torch.tensor(prompts[0][:shared], dtype=torch.long), 1
        for row, rest in enumerate(rests):
            ids[row, length - len(rest):] = torch.tensor(rest, dtype=torch.long)
            mask[row, length - len(rest):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        prefix = new_cache(self.model, shared) if shared else None
        if prefix is not None:
            self._forward(ids[:1, :shared], mask[:1, :shared], positions[:1, :shared], prefix)
        return self._prefill_rows(ids, mask, positions, shared, capacity, prefix, images)

    def _prefill_rows(self, ids, mask, positions, shared: int, capacity: int, prefix, images):
        """``_prefill``'s forward of every prompt's columns from ``shared`` on, in chunks of at most
        ``max_num_batched_tokens`` tokens, each on a copy of the ``prefix`` cache (or a new cache)."""
        caches, logits, deltas = [], [], []
        for rows in prefill_chunks(ids.shape[0], ids.shape[1] - shared, self.max_num_batched_tokens):
            sl, extra = slice(rows.start, rows.stop), {}
            cache = new_cache(self.model, capacity) if prefix is None else \
                take_rows(prefix, torch.zeros(len(rows), dtype=torch.long, device=ids.device), capacity - shared)
            chunk_positions = positions[sl, shared:]
            if images is not None:  # the model's 3-D positions (and image embeddings)
                extra, chunk_positions, delta = prefill_inputs(self._sampler, ids[sl], mask[sl], images[sl])
                deltas.append(delta)
            logits.append(self._forward(ids[sl, shared:], mask[sl], chunk_positions, cache, **extra))
            caches.append(cache)
        lengths = mask.sum(-1) + (torch.cat(deltas) if deltas else 0)
        return concat_caches(caches), torch.cat(logits), mask, lengths

    def _run_wave(self, prompts: list[list[int]], counts: list[int], sampling: SamplingParams,
                  stops: torch.Tensor, rows: "WaveRows") -> list[list[RolloutOutput]]:
        """Prefill ``prompts`` once, expand to ``counts`` rows each, decode all rows to completion
        (row ``r`` draws its ``t``-th token from stream ``rows.states[r]`` at ``rows.offsets[r] + t``).

        Each step feeds every row its last token, plus (speculation) draft tokens, and samples a
        token after every fed position; a row emits its first sample and, while its draft agrees
        with its samples, the next ones (see the module docstring)."""
        device, max_tokens = self.device, sampling.max_tokens
        cache, logits, base, mask, cur_len, static, drafter = self._start_wave(prompts, counts, max_tokens, rows.images)
        num_rows = logits.shape[0]
        out_tokens = torch.full((num_rows, max_tokens), self.pad_token_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros((num_rows, max_tokens), dtype=torch.float32, device=device)
        out_len = torch.zeros((num_rows,), dtype=torch.long, device=device)  # tokens emitted so far
        out_stop = torch.zeros((num_rows,), dtype=torch.bool, device=device)
        caps = torch.full((num_rows,), max_tokens, device=device) if rows.caps is None else rows.caps
        active = torch.arange(num_rows, device=device)  # original row id of each batch row
        finished = torch.zeros((num_rows,), dtype=torch.bool, device=device)
        drafts = torch.zeros((num_rows, 0), dtype=torch.long, device=device)  # fed after each row's last token

        for step in range(max_tokens):
            fed = logits.shape[1]  # 1 + draft tokens: a sample after each fed position
            emitted = out_len[active]
            index = torch.arange(fed, device=device)
            draws = None if sampling.greedy else uniforms(
                rows.states[active, None].expand(-1, fed).reshape(-1),
                (rows.offsets[active] + emitted)[:, None].add(index).reshape(-1))
            tokens, logprobs = sample_next(logits.reshape(-1, logits.shape[-1]), sampling, draws)
            tokens, logprobs = tokens.view(-1, fed), logprobs.view(-1, fed)
            valid, is_stop = emitted_samples(tokens, drafts, emitted, caps[active], stops, finished)
            new = valid.sum(1)
            if fed > 1:  # the draft slots fed to unfinished rows, and those whose draft was accepted
                self._drafted += int((~finished).sum()) * (fed - 1)
                self._accepted += int((new - 1).clamp(min=0).sum())
            live, col = valid.nonzero(as_tuple=True)
            out_tokens[active[live], emitted[live] + col] = tokens[live, col]
            out_logprobs[active[live], emitted[live] + col] = logprobs[live, col]
            emitted = emitted + new
            out_len[active] = emitted
            hit = is_stop.any(1)
            if bool(hit.any()):
                out_stop[active[hit]] = True
            finished |= hit | (emitted >= caps[active])
            if bool(finished.all()):
                break
            if rows.stop_when is not None and (step + 1) % rows.stop_every == 0:
                done = torch.ones(num_rows, dtype=torch.bool, device=device)  # compacted rows are finished
                done[active] = finished
                if rows.stop_when(done.tolist()):
                    break
            last = tokens.gather(1, (new - 1).clamp(min=0)[:, None]).squeeze(1)
            if fed > 1:  # the rejected drafts' cache columns are never attended to again
                mask[:, cur_len - fed + 1:cur_len] = index[1:] < new[:, None]
            num_done = int(finished.sum())
            if static is None and num_done and num_done >= self.compact_fraction * finished.numel():
                keep = (~finished).nonzero().squeeze(1)
                select_rows(cache, keep)
                mask, base, active = mask[keep], base[keep], active[keep]
                last, finished = last[keep], finished[keep]
            last = last.masked_fill(finished, self.pad_token_id)
            drafts = drafter.drafts(out_tokens, out_len, active, finished) if drafter is not None \
                else last.new_zeros((last.numel(), 0))
            feed = torch.cat([last[:, None], drafts], 1)
            if cur_len + feed.shape[1] > mask.shape[1]:  # rejected drafts took columns: grow
                mask = torch.cat([mask, torch.zeros_like(mask)], 1)
            mask[:, cur_len:cur_len + feed.shape[1]] = 1
            cur_len += feed.shape[1]
            positions = (base + out_len[active] - 1)[:, None] + torch.arange(feed.shape[1], device=device)
            if static is None:
                logits = self._forward(feed, mask[:, :cur_len], positions, cache, keep=feed.shape[1])
            else:
                logits = self._static_step(last, mask, positions[:, 0], cache)[:, None]
        return self._collect(counts, out_tokens, out_logprobs, out_len, out_stop)

    def _start_wave(self, prompts: list[list[int]], counts: list[int], max_tokens: int, images=None):
        """The prefilled wave expanded to ``counts`` rows a prompt: its cache (static when the
        engine decodes on fixed shapes), the next-token logits ``[rows, 1, V]``, each row's prompt
        length (plus its rope delta, with ``images``), the attention mask over the cache's columns (switched on as tokens are fed), the
        columns filled so far, the static cache (or None) and the n-gram drafter (or None)."""
        device = self.device
        capacity = max(len(p) for p in prompts) + max_tokens
        cache, logits, prompt_mask, lengths = self._prefill(prompts, capacity, images)
        expand = torch.repeat_interleave(torch.arange(len(prompts), device=device),
                                         torch.tensor(counts, device=device))
        select_rows(cache, expand)
        logits, base = logits.index_select(0, expand)[:, None], lengths.index_select(0, expand)
        num_rows, cur_len = expand.numel(), prompt_mask.shape[1]
        static = to_static(cache, self._sampler, -(-capacity // STATIC_BUCKET) * STATIC_BUCKET) \
            if self.static_cache else None
        # a static step attends over the whole capacity
        mask = torch.zeros((num_rows, capacity if static is None else static.layers[0].max_cache_len),
                           dtype=torch.long, device=device)
        mask[:, :cur_len] = prompt_mask.index_select(0, expand)
        drafter = Drafter(prompts, expand.tolist(), self.speculative_tokens, self.speculative_budget,
                           self.pad_token_id) \
            if self.speculative_tokens and static is None else None
        return cache if static is None else static, logits, base, mask, cur_len, static, drafter

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
