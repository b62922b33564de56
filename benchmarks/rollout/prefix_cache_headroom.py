"""What a cross-request prefix cache could save in the native engine (``generate_config.enable_prefix_caching``).

Times, on ``tiny_qwen2`` (random init, CPU, 1 thread), a GRPO-shaped call (8 prompts x 8 samples, 48-token
prompts, 32 new tokens) and the same call with 1 new token (its prefill); then a multi-turn turn 2 done by
re-prefilling the 96-token conversations (64 rows). The first shows the prefill a call already shares once per
prompt; the second what the multi-turn engine's kept KV cache saves (posttrain.rollout.multi_turn). Between
calls the trainer steps the optimizer, so a cache kept across calls would hold stale keys and values.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/rollout/prefix_cache_headroom.py [out_dir]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from posttrain.commands.init_model import init_model
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine


def main(out: Path) -> None:
    torch.set_num_threads(1)
    model_dir = out / "tiny" if (out / "tiny").is_dir() else init_model("tiny_qwen2", out / "tiny", seed=1234)
    engine = NativeEngine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), pad_token_id=0, eos_token_ids=[])
    g = torch.Generator().manual_seed(0)

    def timed(prompts, n, max_tokens, reps=3):
        sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=-1, top_p=1.0, seed=1)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            engine.generate(prompts, n, sampling)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    prompts = [torch.randint(1, 200, (48,), generator=g).tolist() for _ in range(8)]
    call, prefill = timed(prompts, 8, 32), timed(prompts, 8, 1)
    print(f"GRPO call: {call:.3f} s; its prefill (+1 token): {prefill:.3f} s ({prefill / call:.1%})")
    turn2 = [p + torch.randint(1, 200, (48,), generator=g).tolist() for p in prompts for _ in range(8)]
    turn, reprefill = timed(turn2, 1, 32), timed(turn2, 1, 1)
    print(f"multi-turn turn 2, re-prefilled: {turn:.3f} s; its prefill: {reprefill:.3f} s ({reprefill / turn:.1%})")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/prefix_cache_headroom"))
