"""Per-iteration data metrics with the seed's key names, and the seed's throughput formulas.

Inputs may be a tensor ``[B]`` / ``[B, 1]`` / ``[B, T]`` or a list of per-row 1-D tensors as the
TransferDock returns them; per-row values are row sums (a length stored as ``[L]`` gives ``L``;
token-level ``rm_scores`` give the sequence score). torch is imported when a function needs it, so
the reward package (``{verifier}_rewards/mean``) and ``import posttrain.metrics`` stay torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def per_row(values: Any):
    """``[B]`` float64 tensor of row sums of a tensor or a list of row tensors."""
    import torch  # lazy: posttrain.metrics stays free of torch

    if isinstance(values, torch.Tensor):
        t = values.detach().to(torch.float64)
        return t.reshape(t.shape[0], -1).sum(dim=1) if t.dim() > 1 else t.reshape(-1)
    return torch.stack([torch.as_tensor(r).detach().to(torch.float64).sum() for r in values]) \
        if len(values) else torch.empty(0, dtype=torch.float64)


def stat_metrics(prefix: str, values: Any, mask: Any = None) -> dict[str, float]:
    """``{prefix}/mean``, ``/max``, ``/min`` over all elements (over ``mask == 1`` if given).

    Used for critic/advantages, critic/returns, critic/values (token level, masked).
    """
    import torch  # lazy: posttrain.metrics stays free of torch

    t = torch.as_tensor(values).detach().to(torch.float64)
    if mask is not None:
        t = t[torch.as_tensor(mask).bool()]
    t = t.reshape(-1)
    if t.numel() == 0:
        return {}
    return {f"{prefix}/mean": t.mean().item(), f"{prefix}/max": t.max().item(),
            f"{prefix}/min": t.min().item()}


def length_metrics(prefix: str, lengths: Any, max_length: int | None = None) -> dict[str, float]:
    """``{prefix}/mean|max|min``; with ``max_length``, ``{prefix}/clip_ratio`` = share of rows with
    ``length >= max_length`` (truncated by the generation limit; posttrain addition)."""
    import torch  # lazy: posttrain.metrics stays free of torch

    rows = per_row(lengths)
    out = stat_metrics(prefix, rows)
    if max_length is not None and rows.numel():
        out[f"{prefix}/clip_ratio"] = (rows >= max_length).to(torch.float64).mean().item()
    return out


def response_length_metrics(response_length: Any, max_response_length: int | None = None,
                            ) -> dict[str, float]:
    """``response_length/{mean,max,min}`` (+ ``clip_ratio`` when the max length is given)."""
    return length_metrics("response_length", response_length, max_response_length)


def prompt_length_metrics(prompt_length: Any) -> dict[str, float]:
    """``prompt_length/{mean,max,min}``."""
    return length_metrics("prompt_length", prompt_length)


def score_metrics(rm_scores: Any, algorithm: str = "grpo") -> dict[str, float]:
    """``{algorithm}/score/{mean,max,min}`` of sequence scores ``s_i = sum_t rm_scores[i, t]``."""
    return stat_metrics(f"{algorithm}/score", per_row(rm_scores))


def data_metrics(rm_scores: Any, response_length: Any, prompt_length: Any, *,
                 algorithm: str = "grpo", max_response_length: int | None = None) -> dict[str, float]:
    """The per-iteration data block: ``{algorithm}/score/*``, ``response_length/*``, ``prompt_length/*``."""
    return {**score_metrics(rm_scores, algorithm),
            **response_length_metrics(response_length, max_response_length),
            **prompt_length_metrics(prompt_length)}


def verifier_reward_metrics(rewards: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``{verifier}_rewards/mean`` = mean over samples of each verifier's raw score (0.0 for no samples).

    The rule reward reports these for every scoring call."""
    return {f"{name}_rewards/mean": (sum(float(v) for v in values) / len(values) if len(values) else 0.0)
            for name, values in rewards.items()}


TPS_TIMINGS = {"e2e_tps": "timing/all", "update_tps": "timing/update", "vllm_tps": "timing/rollout"}


def compute_tps(metrics: Mapping[str, float], *, global_batch_size: int, n_samples_per_prompt: int,
                world_size: int, log_max_throughput: bool = False, num_gen_batches: int = 1,
                update_batch_size: int | None = None) -> dict[str, float]:
    """Tokens per second per device, the seed's ``compute_tps``::

        tps = (L_resp + L_prompt) * gbs * n / world_size / T

    ``L_*`` = ``response_length/mean`` and ``prompt_length/mean`` (``/max`` when
    ``log_max_throughput``), ``gbs`` in prompts, and ``T`` = ``timing/all`` (e2e_tps),
    ``timing/update`` (update_tps), ``timing/rollout`` (vllm_tps). DAPO filtering: e2e/vllm use
    ``gbs * num_gen_batches`` and update uses ``update_batch_size`` (filter_groups_train_batch_size).
    A tps whose timing is missing or zero is left out.
    """
    stat = "max" if log_max_throughput else "mean"
    resp, prompt = metrics.get(f"response_length/{stat}"), metrics.get(f"prompt_length/{stat}")
    if resp is None or prompt is None:
        return {}
    out = {}
    for name, timing_key in TPS_TIMINGS.items():
        seconds = metrics.get(timing_key)
        if not seconds or seconds <= 0:
            continue
        gbs = global_batch_size * num_gen_batches
        if name == "update_tps" and update_batch_size is not None:
            gbs = update_batch_size
        out[name] = (resp + prompt) * gbs * n_samples_per_prompt / world_size / seconds
    return out
