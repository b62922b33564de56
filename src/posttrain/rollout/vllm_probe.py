"""Proof that a vLLM engine holds the trainer's weights: after each weight sync the engine scores a
fixed probe sequence (its prompt log-probs, temperature 1) and the trainer's model scores the same
tokens; the largest difference over the scored tokens is ``rollout/sync_probe_diff``. Beyond the tolerance of the
engine's precision the run stops, and the message names the first decoder layer whose output
differs (each layer's residual stream, captured by forward hooks in vLLM and in the Hugging Face model).

The probe is a short prefix of token ids spread over the vocabulary by a fixed stride (no tokenizer
needed), continued greedily by the engine when it starts (:func:`greedy_continuation`); only the
continuation is scored. Its tokens are the likely ones, whose log-probs are near 0: there the
rounding of a bf16 side is small, while on unlikely tokens (log-probs near -20) it reaches several
nats without any weight being wrong (measured on SmolLM2-135M). The sequence is fixed at the start
and scored again after every sync.
"""

from __future__ import annotations

from typing import Any

import torch

PREFIX_LENGTH = 8
CONTINUATION_LENGTH = 40
# the largest |log-prob difference| a correct sync shows on the continuation, by the less precise side
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.75, "float16": 0.5}


def probe_ids(vocab_size: int, length: int = PREFIX_LENGTH) -> list[int]:
    """``length`` token ids spread over ``[1, vocab_size)`` by a fixed stride (no special ids needed)."""
    stride = 7919  # a prime, so consecutive ids land far apart
    return [1 + (i * stride) % (vocab_size - 1) for i in range(length)]


def greedy_continuation(llm: Any, prefix: list[int], length: int = CONTINUATION_LENGTH) -> list[int]:
    """``prefix`` and the engine's greedy continuation of it (``length`` tokens, EOS ignored)."""
    import vllm

    params = vllm.SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": list(prefix)}], params, use_tqdm=False)[0].outputs[0]
    return list(prefix) + list(out.token_ids)


def trainer_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """``log p(ids[t] | ids[:t])`` for t >= 1 under ``model`` (an HF causal LM), in fp32."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, :-1]
    logprobs = logits.float().log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].cpu()


def engine_logprobs(llm: Any, ids: list[int]) -> torch.Tensor:
    """The same log-probs from a ``vllm.LLM`` (its prompt log-probs at temperature 1)."""
    import vllm

    params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0].prompt_logprobs
    return torch.tensor([out[t][ids[t]].logprob for t in range(1, len(ids))], dtype=torch.float32)


def _capture_layers(model: Any) -> int:
    """Hook every decoder layer of vLLM's model (in its worker) to keep its output."""
    layers = model.model.layers
    model._posttrain_probe = {}

    def keep(i):
        def hook(_module, _inputs, output):
            hidden, residual = output if isinstance(output, tuple) else (output, None)
            stream = hidden if residual is None else hidden + residual  # vLLM defers the residual add
            model._posttrain_probe[i] = stream.detach().float().cpu().clone()
        return hook

    model._posttrain_hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    return len(layers)


def _release_layers(model: Any) -> dict[int, torch.Tensor]:
    for handle in model._posttrain_hooks:
        handle.remove()
    captured = model._posttrain_probe
    del model._posttrain_hooks, model._posttrain_probe
    return captured


def trainer_layers(model: Any, ids: list[int]) -> dict[int, torch.Tensor]:
    """Each decoder layer's output (the residual stream) in the trainer's HF model on ``ids``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    captured: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(_module, _inputs, output):
            captured[i] = (output[0] if isinstance(output, tuple) else output)[0].detach().float().cpu()
        return hook

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(base.model.layers)]
    try:
        trainer_logprobs(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def first_differing_layer(llm: Any, ours: dict[int, torch.Tensor] | None, ids: list[int], tolerance: float) -> str:
    """Where vLLM's forward first departs from the trainer's on ``ids``: ``model.layers.N`` (its
    output's largest difference relative to the trainer's scale), or the embedding or output layer
    when every decoder layer agrees. ``ours``: the trainer's layer outputs (:func:`trainer_layers`;
    None when the trainer cannot give them). Runs in this process only (``LLM.apply_model``)."""
    if ours is None:
        return "(the trainer's layer outputs are not available to compare)"
    try:
        llm.apply_model(_capture_layers)
        engine_logprobs(llm, ids)
        captured = llm.apply_model(_release_layers)[0]
    except Exception as exc:  # a model without .model.layers, or an engine in other processes
        return f"(the layer could not be found: {type(exc).__name__}: {exc})"
    threshold = max(tolerance, 1e-3) * 10
    for i, theirs in sorted(captured.items()):
        if i not in ours or theirs.shape != ours[i].shape:
            continue
        scale = ours[i].abs().max().clamp_min(1e-6)
        if ((theirs - ours[i]).abs().max() / scale).item() > threshold:
            return f"model.layers.{i}"
    return "the embedding, the final norm or the output layer (every decoder layer agrees)"
