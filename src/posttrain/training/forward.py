"""The response-token forward pass shared by training and log-prob computation.

The batch layout is :mod:`posttrain.training.batch`'s (``position_ids`` may be left out: they
default to :func:`~posttrain.training.batch.default_position_ids`). Response token ``t`` of row ``b`` is ``input_ids[b, P + t]`` and its log-prob is read from the
logits at position ``P + t - 1`` (the seed's ``[prompt_len - 1, prompt_len + resp_len - 1)``
window). Logits are divided by the sampling temperature (seed section 2.1), so the result equals
the sampler's log-prob of the same token. When the model accepts ``logits_to_keep`` (HF causal
LMs), logits are only computed for the last ``R + 1`` positions, not for the prompt, and the LM
head runs a chunk of tokens at a time (:mod:`posttrain.training.lm_head`).
"""

from __future__ import annotations

import inspect

import torch

from posttrain.algo.logprob import entropy_from_logits, logprobs_from_logits
from posttrain.algo.truncation import Truncation
from posttrain.training.batch import default_position_ids, response_width
from posttrain.training.lm_head import detached_head, head_logprobs
from posttrain.training.multimodal import TOWER_ANCHOR, is_multimodal, model_kwargs, multimodal_inputs
from posttrain.training.remove_padding import Packing, packed_response_logprobs


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    cached = getattr(model, "_posttrain_logits_to_keep", None)
    if cached is None:
        inner = getattr(model, "module", model)  # DDP wraps the HF model in .module
        cached = "logits_to_keep" in inspect.signature(inner.forward).parameters
        model._posttrain_logits_to_keep = cached
    return cached


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = default_position_ids(batch["attention_mask"])
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "position_ids": position_ids,
        **model_kwargs(batch),  # a multimodal batch: its image features (training/multimodal.py)
    }


def response_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits predicting each response token: ``[B, R, V]`` (positions ``P-1 .. P+R-2``); the
    hidden states ``[B, R, H]`` inside :func:`~posttrain.training.lm_head.detached_head`."""
    num_resp = response_width(batch)
    kwargs = _model_inputs(batch)
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = num_resp + 1
    output = model(**kwargs, use_cache=False)
    logits = output.logits if hasattr(output, "logits") else output
    return logits[:, -(num_resp + 1) : -1]


def response_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    packing: Packing | None = None,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, R]`` of the response tokens (0 on padding) and optionally their entropy.

    ``entropy_grad=False`` computes the entropy without building a graph (for a metric only).
    ``temperature=0`` (greedy sampling) means 1, as the rollout engine reports greedy log-probs.
    With ``packing`` (``rl_config.use_remove_padding``) the forward runs on the packed row of
    :mod:`posttrain.training.remove_padding`. A multimodal batch (``pixel_values``/``image_grid_thw``,
    :mod:`posttrain.training.multimodal`) runs the vision tower (or reuses ``image_embeds``) and the
    model's 3-D rotary positions; its packed rows never share a prompt (equal tokens, other images).
    With ``truncation`` (``rl_config.truncated_sampling_logprobs``) the log-probs are those of the
    truncated sampling distribution.
    """
    if is_multimodal(batch):
        batch = multimodal_inputs(model, batch)
        packing = Packing(share_prompts=False) if packing is not None else None
        anchor = batch.pop(TOWER_ANCHOR, None)
        if anchor is not None:  # a text-only micro-batch of a DDP replica whose tower trains: a zero term
            logprobs, entropy = response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy,
                                                  entropy_grad=entropy_grad, packing=packing, truncation=truncation)
            return logprobs + anchor, entropy
    if packing is not None:
        return packed_response_logprobs(model, batch, temperature=temperature, with_entropy=with_entropy,
                                        entropy_grad=entropy_grad, share_prompts=packing.share_prompts,
                                        truncation=truncation)
    temperature = temperature if temperature > 0 else 1.0
    num_resp = response_width(batch)
    labels = batch["input_ids"][:, -num_resp:]
    with detached_head(model) as head:  # the forward returns hidden states: the head runs in chunks
        out = response_logits(model, batch)
    if head is not None:
        logprobs, entropy = head_logprobs(head, out, labels, temperature, with_entropy=with_entropy,
                                          entropy_grad=entropy_grad, truncation=truncation)
    else:
        logprobs = logprobs_from_logits(out, labels, temperature, truncation=truncation)
        entropy = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropy = entropy_from_logits(out, temperature)
    valid = batch["response_mask"].bool()
    zero = torch.zeros((), device=out.device)
    # where, not a product: a padded label may have a -inf logit (masked vocab), and -inf * 0 = NaN
    logprobs = torch.where(valid, logprobs, zero)
    entropy = torch.where(valid, entropy, zero) if entropy is not None else None
    return logprobs, entropy


def response_values(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Critic values ``[B, R]`` at the same shifted positions as the log-probs (seed 2.4).

    The model returns ``[B, T, 1]`` (or ``[B, T]``) scores, as an object with ``.logits`` or a
    tensor; values are not temperature-scaled (seed quirk 6).
    """
    num_resp = response_width(batch)
    output = model(**_model_inputs(batch), use_cache=False)
    scores = output.logits if hasattr(output, "logits") else output
    if scores.ndim == 3:
        scores = scores[..., 0]
    return scores[:, -(num_resp + 1) : -1].float() * batch["response_mask"].to(torch.float32)
