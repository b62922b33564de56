"""Greedy accuracy and sampled-group statistics with plain Hugging Face ``generate``.

A helper of the measurement scripts next to it (``baseline_eval.py``, ``measure_timing.py``,
``sanity_grpo.py``), which import it as a sibling module; it is not part of the package.

This is the demo's independent yardstick (it does not use posttrain's rollout engine), so a
GRPO run can be judged by the same measurement before and after training:

* greedy accuracy = mean over problems of ``score(greedy_response, answer)``;
* a group of ``n`` samples of one prompt is *mixed* when its rewards are not all equal, i.e.
  it carries a non-zero GRPO advantage ``(r_i - mean(r)) / (std(r) + eps)``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from demo_scoring import score as demo_score

Scorer = Callable[[str, str], float]


def load_model(model_dir: str | Path, threads: int | None = 2):
    """Load (model, tokenizer) in fp32 for CPU, eval mode, tokenizer padding on the left."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tokenizer


def chat_prompts(tokenizer, user_messages: list[str], system: str | None = None) -> list[str]:
    """Apply the chat template (with generation prompt) to each user message."""
    out = []
    for message in user_messages:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": message})
        out.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True))
    return out


def autocast(dtype: str):
    """Context manager: bf16 CPU autocast for ``dtype == "bf16"``, else nothing."""
    import torch

    if dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, n: int = 1,
             temperature: float = 0.0, top_p: float = 1.0, dtype: str = "fp32",
             seed: int | None = None) -> tuple[list[str], list[int]]:
    """Batched generation; returns (texts, response token counts), ``n`` rows per prompt in order.

    ``temperature == 0`` means greedy decoding. Counts include the final eos when generated.
    """
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, num_return_sequences=n)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(do_sample=False)
    with torch.inference_mode(), autocast(dtype):
        out = model.generate(**batch, **kwargs)
    new = out[:, batch["input_ids"].shape[1]:]
    lengths = _response_lengths(new, tokenizer.eos_token_id, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return texts, lengths


def _response_lengths(new_tokens, eos_id: int, pad_id: int) -> list[int]:
    """Tokens up to and including the first eos (or all tokens when none)."""
    lengths = []
    for row in new_tokens.tolist():
        length = len(row)
        for i, tok in enumerate(row):
            if tok == eos_id or (tok == pad_id and pad_id != eos_id):
                length = i + 1
                break
        lengths.append(length)
    return lengths


@dataclass
class EvalResult:
    """Summary of one evaluation; ``records`` keeps per-response details."""

    accuracy: float
    num_problems: int
    mean_length: float
    max_length: int
    truncated_fraction: float
    seconds: float
    mixed_group_fraction: float | None = None
    records: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """Everything except the records, rounded for printing."""
        keys = ("accuracy", "num_problems", "mean_length", "max_length", "truncated_fraction",
                "seconds", "mixed_group_fraction")
        return {k: (round(v, 4) if isinstance(v, float) else v)
                for k in keys if (v := getattr(self, k)) is not None}


def evaluate(model, tokenizer, rows: list[dict], *, max_new_tokens: int = 128,
             batch_size: int = 16, n: int = 1, temperature: float = 0.0,
             system: str | None = None, dtype: str = "fp32", scorer: Scorer | None = None,
             seed: int = 0) -> EvalResult:
    """Score ``n`` responses per row; accuracy is the mean reward over all responses.

    With ``n > 1`` the fraction of prompts whose ``n`` rewards are not all equal is reported
    as ``mixed_group_fraction``. Rows need ``prompt`` (user message) and ``answer``.
    """
    scorer = scorer or demo_score
    start = time.perf_counter()
    records, mixed = [], []
    for lo in range(0, len(rows), batch_size):
        chunk = rows[lo:lo + batch_size]
        prompts = chat_prompts(tokenizer, [r["prompt"] for r in chunk], system)
        texts, lengths = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, n=n,
                                  temperature=temperature, dtype=dtype, seed=seed + lo)
        for i, row in enumerate(chunk):
            rewards = []
            for j in range(n):
                text, length = texts[i * n + j], lengths[i * n + j]
                reward = scorer(text, row["answer"])
                rewards.append(reward)
                records.append({"problem": row["problem"], "answer": row["answer"],
                                "response": text, "length": length, "reward": reward})
            mixed.append(len(set(rewards)) > 1)
    lengths = [r["length"] for r in records]
    return EvalResult(
        accuracy=statistics.fmean(r["reward"] for r in records),
        num_problems=len(rows),
        mean_length=statistics.fmean(lengths),
        max_length=max(lengths),
        truncated_fraction=sum(x >= max_new_tokens for x in lengths) / len(lengths),
        seconds=time.perf_counter() - start,
        mixed_group_fraction=statistics.fmean(mixed) if n > 1 else None,
        records=records,
    )
