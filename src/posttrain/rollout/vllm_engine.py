"""vLLM behind the ``RolloutEngine`` interface (GPU machines; ``vllm`` is imported lazily).

The engine is built from the actor's config with dummy weights, then loads the actor's state dict
(``update_weights``), so it never reads a checkpoint from disk and can be refreshed after every
optimizer step. Prompts go in as token ids (``TokensPrompt``) and come back as token ids; nothing is
detokenised or re-tokenised (the seed decodes prompts to text and lets vLLM re-tokenise them).

Logprobs: vLLM returns the logprob of each sampled token. Recent vLLM lets you choose which one
(``logprobs_mode``): ``"processed_logprobs"`` (default here) is after temperature and top-k/top-p
truncation; the native engine and the trainer use the untruncated tempered distribution, so with
truncation on the two differ by ``log(kept mass)`` (see docs/rollout.md).

Seeds: each prompt is its own request, seeded with ``derive_seed(sampling.seed, prompt_keys[i])``
(a splitmix64 hash, :mod:`posttrain.rollout.keyed`), so a prompt's samples do not depend on the
other prompts of the call or on how the prompts are split over workers. What remains different
from the native engine: vLLM draws from its own per-request generator, so the tokens differ from
the native engine's for the same seed; a request's ``n`` samples share that generator, so sample
``j`` depends on ``n``; the draws follow vLLM's kernels and version; and a continued response
(position offset) is not supported (a continuation would start a fresh request stream).
"""

from __future__ import annotations

import tempfile
from typing import Any

from posttrain.errors import ConfigError
from posttrain.rollout.base import RolloutOutput, SamplingParams
from posttrain.rollout.keyed import MASK64, absorb_int, random_seed


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


class VLLMEngine:
    """``RolloutEngine`` on ``vllm.LLM``, with weights taken from the actor's ``state_dict``."""

    def __init__(self, model: Any, *, eos_token_ids: list[int] | int | None = None, dtype: str = "bfloat16",
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int = 2048,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1, enforce_eager: bool = True,
                 logprobs_mode: str | None = "processed_logprobs", pad_token_id: int | None = None,
                 **llm_kwargs: Any):
        vllm = _import_vllm()
        self._workdir = tempfile.TemporaryDirectory(prefix="posttrain_vllm_")
        model.config.save_pretrained(self._workdir.name)  # config only: weights come from the state dict
        eos = [] if eos_token_ids is None else ([eos_token_ids] if isinstance(eos_token_ids, int) else eos_token_ids)
        self.eos_token_ids = [int(t) for t in eos]
        kwargs = dict(model=self._workdir.name, load_format="dummy", skip_tokenizer_init=True,
                      dtype={"float32": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype),
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
                      max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                      tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager, **llm_kwargs)
        if logprobs_mode is not None:
            kwargs["logprobs_mode"] = logprobs_mode
        try:
            self.llm = vllm.LLM(**kwargs)
        except TypeError:  # older vLLM without logprobs_mode
            kwargs.pop("logprobs_mode", None)
            self.llm = vllm.LLM(**kwargs)
        self.update_weights(model.state_dict())

    def update_weights(self, state_dict: dict[str, Any]) -> None:
        """Load the actor's weights (HF names) into the vLLM model, in place."""
        weights = [(name, tensor.detach()) for name, tensor in state_dict.items()]

        def load(model):  # runs inside the worker that holds the vLLM model
            model.load_weights(weights=weights)

        if hasattr(self.llm, "apply_model"):
            self.llm.apply_model(load)
        else:  # older vLLM: the in-process driver worker
            load(self.llm.llm_engine.model_executor.driver_worker.model_runner.model)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()

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
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return [[self._convert(c) for c in req.outputs] for req in results]

    @staticmethod
    def _convert(completion: Any) -> RolloutOutput:
        ids = list(completion.token_ids)
        logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
        reason = "stop" if completion.finish_reason == "stop" else "length"
        return RolloutOutput(token_ids=ids, logprobs=logprobs, finish_reason=reason)
