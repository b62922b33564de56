"""vLLM behind the ``RolloutEngine`` interface (GPU machines; ``vllm`` is imported lazily).

**Unverified on a GPU**: only a fake ``vllm`` module (tests/unit/rollout/test_vllm_fake.py) has
checked the calls below; docs/rollout.md says what that does and does not prove.

Weights. The engine builds ``vllm.LLM`` from the actor's config with dummy weights (it never reads a
checkpoint from disk), then :meth:`VLLMEngine.sync_weights` loads the actor's current weights into
vLLM's model, one tensor per ``load_weights`` call, under their Hugging Face names (a tied
embedding once), so no second full copy of the weights is built. The on-policy trainer calls it
after every update (``timing/resharding_to_infer``). The model is reached in this process
(``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``): the engine sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the environment sets it; where the model is not
reachable (multiprocessing on, tensor parallelism) each tensor goes through ``LLM.apply_model``.

Memory (``sleep_mode``, on by default). The LLM is built with ``enable_sleep_mode=True``; after each
``generate`` the engine calls ``llm.sleep(level=1)`` (the KV cache is freed and the weights move to
host memory while the trainer runs); ``sync_weights`` wakes the weights alone
(``wake_up(tags=["weights"])``; a vLLM without tags wakes everything), loads them and resets the
prefix cache; ``generate`` wakes the weights (if still asleep) and then the KV cache
(``wake_up(tags=["kv_cache"])``). The engine tracks what is asleep, so no call is doubled.

Token ids only: prompts go in as ``{"prompt_token_ids": ...}`` (vLLM's ``TokensPrompt``) with
``skip_tokenizer_init=True`` and come back as token ids (``detokenize=False``); nothing is decoded
and re-tokenised (the seed decodes prompts to text and lets vLLM re-tokenise them).

Logprobs: ``logprobs_mode="processed_logprobs"``, and ``logprobs=0`` (the sampled token's only).
vLLM computes these after its temperature, min-p and top-k/top-p processing: the log-softmax of the
tempered logits with the filtered tokens at -inf, i.e. the log-prob under the distribution the
token was drawn from. The trainer (and the native engine) use the tempered but *untruncated*
distribution, ``log_softmax(logits / T)`` over the whole vocabulary. The two are equal when no
truncation is on (``top_k: -1``, ``top_p: 1``, ``min_p: 0``); with truncation vLLM's value is higher
by ``-log(kept mass)`` (the mass of the kept tokens under the tempered distribution). The other
modes differ more: ``raw_logprobs`` (vLLM's default) is the log-softmax of the logits before the
temperature, so it differs at every ``T != 1``. At ``temperature: 0`` (greedy) vLLM skips the
temperature and both engines report ``log_softmax(logits)``. A vLLM whose ``LLM`` has no
``logprobs_mode`` argument is refused (its V1 engine reports raw logprobs).

Seeds: each prompt is its own request, seeded with ``derive_seed(sampling.seed, prompt_keys[i])``
(a splitmix64 hash, :mod:`posttrain.rollout.keyed`), so a prompt's samples do not depend on the
other prompts of the call or on how the prompts are split over workers. What remains different
from the native engine: vLLM draws from its own per-request generator, so the tokens differ from
the native engine's for the same seed; a request's ``n`` samples share that generator, so sample
``j`` depends on ``n``; the draws follow vLLM's kernels and version; and a continued response
(position offset) is not supported (a continuation would start a fresh request stream).
"""

from __future__ import annotations

import inspect
import os
import tempfile
from typing import Any

import torch

from posttrain.errors import ConfigError
from posttrain.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from posttrain.rollout.keyed import MASK64, absorb_int, random_seed

LOGPROBS_MODE = "processed_logprobs"
OUT_OF_MEMORY = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


def derive_seed(seed: int, prompt_key: int) -> int:
    """A 63-bit request seed from the call's seed and the prompt's key (splitmix64 of both)."""
    return absorb_int(absorb_int(0, seed), prompt_key) & (MASK64 >> 1)


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ConfigError("rollout engine 'vllm' needs the vllm package (pip install 'posttrain[vllm]', "
                          "CUDA GPUs); use engine 'native' otherwise.") from exc
    return vllm


def _memory_advice(max_num_seqs: int | None, gpu_memory_utilization: float | None) -> str:
    return (f"lower generate_config.max_num_seqs (sequences decoded at once: {max_num_seqs}) or "
            f"generate_config.gpu_memory_utilization (vLLM's share of the GPU, weights and KV cache: "
            f"{gpu_memory_utilization}; the trainer's weights, gradients and optimizer state need the rest), or "
            f"generate_config.max_model_len")


class VLLMEngine(RolloutEngine):
    """``RolloutEngine`` on ``vllm.LLM``, loaded with the actor's weights by :meth:`sync_weights`
    (``pop_metrics``: none, the protocol's default)."""

    # defaults for an engine made without __init__ (tests): no sleep mode
    sleep_mode: bool = False
    _asleep: set[str] | frozenset[str] = frozenset()
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None

    def __init__(self, model: Any, *, eos_token_ids: list[int] | int | None = None, dtype: str = "bfloat16",
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1, enforce_eager: bool = True,
                 enable_prefix_caching: bool = False, trust_remote_code: bool = False,
                 enable_expert_parallel: bool = False, sleep_mode: bool = True,
                 logprobs_mode: str = LOGPROBS_MODE, pad_token_id: int | None = None, **llm_kwargs: Any):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process (sync_weights)
        vllm = _import_vllm()
        self._workdir = tempfile.TemporaryDirectory(prefix="posttrain_vllm_")
        model.config.save_pretrained(self._workdir.name)  # config only: the weights come from sync_weights
        eos = [] if eos_token_ids is None else ([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        self.eos_token_ids = [int(t) for t in eos]
        self.max_num_seqs, self.gpu_memory_utilization = max_num_seqs, gpu_memory_utilization
        self.sleep_mode, self._asleep = sleep_mode, set()
        kwargs = dict(model=self._workdir.name, load_format="dummy", skip_tokenizer_init=True,
                      dtype={"float32": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype),
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                      tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                      enable_prefix_caching=enable_prefix_caching, trust_remote_code=trust_remote_code,
                      enable_sleep_mode=sleep_mode, logprobs_mode=logprobs_mode, **llm_kwargs)
        if enable_expert_parallel:  # only when asked: older vLLMs do not know the argument
            kwargs["enable_expert_parallel"] = True
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError as exc:
            if "logprobs_mode" in str(exc):
                raise ConfigError(f"this vLLM ({getattr(vllm, '__version__', '?')}) has no logprobs_mode argument, so "
                                  f"its log-probs are not the tempered ones the trainer compares them with; install "
                                  f"a newer vllm, or use rl_config.rollout_engine: native") from exc
            raise
        except OUT_OF_MEMORY as exc:
            advice = _memory_advice(max_num_seqs, gpu_memory_utilization)
            raise ConfigError(f"vLLM ran out of GPU memory while starting: {advice}") from exc
        except ValueError as exc:  # vLLM: no (or too little) memory left for the KV cache
            if "memory" not in str(exc).lower():
                raise
            raise ConfigError(f"vLLM could not reserve its KV cache ({exc}): raise generate_config."
                              f"gpu_memory_utilization (now {gpu_memory_utilization}) if the trainer leaves room, "
                              f"else lower generate_config.max_model_len or generate_config.max_num_seqs (now "
                              f"{max_num_seqs})") from exc
        self._wake_tags = _takes_tags(self.llm)
        self.sync_weights(model)

    # ---- weights and memory ------------------------------------------------------------------
    def sync_weights(self, model: Any) -> int:
        """Load ``model``'s current weights into vLLM, one tensor per ``load_weights`` call (Hugging
        Face names; a tensor shared by several names, such as tied embeddings, once, under its first
        name); then reset the prefix cache. Returns the number of tensors loaded."""
        self._wake("weights")
        target = self._vllm_model()
        seen: set[int] = set()
        count = 0
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                self._load(target, name, tensor.detach())
                count += 1
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()
        return count

    def _vllm_model(self) -> Any | None:
        """vLLM's model object when it lives in this process (one worker, no multiprocessing), else None."""
        executor = getattr(getattr(self.llm, "llm_engine", None), "model_executor", None)
        worker = getattr(executor, "driver_worker", None)
        worker = getattr(worker, "worker", worker)  # V1: a wrapper around the worker; older: the worker
        return getattr(getattr(worker, "model_runner", None), "model", None)

    def _load(self, target: Any | None, name: str, tensor: torch.Tensor) -> None:
        weights = [(name, tensor)]
        if target is not None:
            target.load_weights(weights=weights)
        elif hasattr(self.llm, "apply_model"):  # each worker gets the full tensor (it shards it in load_weights)
            self.llm.apply_model(lambda m: m.load_weights(weights=weights))
        else:
            raise RuntimeError("the vLLM model is not reachable in this process and this vLLM has no "
                               "LLM.apply_model; unset VLLM_ENABLE_V1_MULTIPROCESSING (posttrain sets it to 0)")

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
        """Level 1: free the KV cache and move the weights to host memory (only when all is awake)."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 stop_token_ids: list[int] | None = None,
                 prompt_keys: list[int] | None = None) -> list[list[RolloutOutput]]:
        """``n`` samples per prompt; prompt ``i`` is seeded by (``sampling.seed``, ``prompt_keys[i]``)."""
        vllm = _import_vllm()
        keys = list(range(len(prompt_token_ids))) if prompt_keys is None else list(prompt_keys)
        if len(keys) != len(prompt_token_ids):
            raise ConfigError(f"generate(): prompt_keys has {len(keys)} entries for {len(prompt_token_ids)} prompts.")
        seed = random_seed() if sampling.seed is None else sampling.seed
        stops = sorted(set(self.eos_token_ids) | set(stop_token_ids or []))
        params = [vllm.SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, min_p=sampling.min_p,
            max_tokens=sampling.max_tokens, seed=derive_seed(seed, key), logprobs=0, detokenize=False,
            stop_token_ids=stops) for key in keys]
        prompts = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        if self.sleep_mode:  # the weights first (when no sync woke them), then the KV cache
            self._wake("weights")
            self._wake("kv_cache")
        try:
            results = self.llm.generate(prompts, params, use_tqdm=False)
        except OUT_OF_MEMORY as exc:
            raise ConfigError(f"vLLM ran out of GPU memory while generating: "
                              f"{_memory_advice(self.max_num_seqs, self.gpu_memory_utilization)}") from exc
        self._sleep()
        return [[self._convert(c) for c in req.outputs] for req in results]

    @staticmethod
    def _convert(completion: Any) -> RolloutOutput:
        ids = list(completion.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
        reason = "stop" if completion.finish_reason == "stop" else "length"
        return RolloutOutput(token_ids=ids, logprobs=logprobs, finish_reason=reason)


def _takes_tags(llm: Any) -> bool:
    """Whether ``llm.wake_up`` takes ``tags`` (wake the weights and the KV cache separately)."""
    try:
        return "tags" in inspect.signature(llm.wake_up).parameters
    except (AttributeError, TypeError, ValueError):
        return False
