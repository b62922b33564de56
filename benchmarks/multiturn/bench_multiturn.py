"""Multi-turn rollout: KV-cache continuation against re-prefilling every turn (issue 19).

Both paths are :class:`posttrain.rollout.multi_turn.MultiTurnEngine` on the same model, prompts,
seed and tools, so they sample the same conversations token for token (checked on every run):

* ``kv``: ``generate``: a row pauses at the end tag, its tool output is fed on top of its KV cache
  while the other rows go on decoding;
* ``reprefill``: ``generate_reprefill``: every turn is a fresh ``generate`` call whose prompt is the
  whole conversation so far, the way an engine without per-row continuation has to do it.

The model is a random-init tiny Qwen2 (``posttrain init-model tiny_qwen2``) or ``--model``. A random
model writes no tool calls, so the end tag is a token that the model samples often (found by a
warm-up call; ``--tag-rank`` picks how frequent, so how long the model turns are) and every turn
that ends there calls an ``echo`` tool whose answer is a fixed sentence (``--tool-words`` words):
the workload is the engine's, not the tools'. Reported: the
median over ``--repeats`` alternating runs of the wall time, sampled tokens per second and all
response tokens (sampled + tool) per second, the ratio kv / reprefill, the tool calls, and the
load average. Results are appended to ``--out``::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/multiturn/bench_multiturn.py --repeats 3 \\
        --out benchmarks/multiturn/results_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch


def build(model_dir: str | None, tool_words: int, max_total: int, max_calls: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.data.templates import get_template
    from posttrain.commands.init_model import init_model
    from posttrain.rollout.multi_turn import MultiTurnEngine, ObservationFormat, TurnLimits
    from posttrain.tools.base import Tool
    from posttrain.tools.hermes import ToolCall
    from posttrain.tools.parsers import ToolParser
    from posttrain.tools.runner import ToolRunner

    if model_dir is None:
        model_dir = str(init_model("tiny_qwen2", Path(tempfile.mkdtemp()) / "model", seed=1234))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    answer = " ".join(f"word{i}" for i in range(tool_words))

    class Echo(Tool):
        def execute(self, arguments: dict) -> str:
            return answer

    schema = {"type": "function", "function": {"name": "echo", "description": "echo",
                                               "parameters": {"type": "object", "properties": {}}}}

    def engine(tag: str) -> MultiTurnEngine:
        parser = ToolParser("every_pause", start_tag="", end_tag=tag, parse=lambda text: [ToolCall(name="echo")])
        return MultiTurnEngine(model, tokenizer=tok, runner=ToolRunner({"echo": Echo(schema)}), parser=parser,
                               observation=ObservationFormat(get_template("qwen_retool"), tok),
                               limits=TurnLimits(max_tool_calls=max_calls, max_total_response_length=max_total),
                               pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])

    return tok, model, engine


def frequent_token(model, tok, prompts, sampling, rank: int) -> int:
    """The ``rank``-th most sampled token (0: the most) that encodes back to itself: rarer tags make
    longer model turns."""
    from posttrain.rollout.native import NativeEngine

    plain = NativeEngine(model, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    counts = Counter(t for group in plain.generate(prompts, 2, sampling) for o in group for t in o.token_ids[4:])
    usable = [t for t, _ in counts.most_common() if tok.encode(tok.decode([t]), add_special_tokens=False) == [t]]
    if len(usable) <= rank:
        raise SystemExit(f"only {len(usable)} tokens of the warm-up round-trip through the tokenizer; lower --tag-rank")
    return usable[rank]


def main(argv=None) -> int:
    from posttrain.rollout.base import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: a random-init tiny Qwen2)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn")
    p.add_argument("--max-total", type=int, default=320, help="max_total_response_length")
    p.add_argument("--max-calls", type=int, default=4)
    p.add_argument("--tool-words", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag-rank", type=int, default=1, help="which frequent token ends a turn (higher: longer turns)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    tok, model, engine_for = build(args.model, args.tool_words, args.max_total, args.max_calls)
    prompts = [tok.encode(f"<|im_start|>user\nquestion {i}: what is {i} * {i + 7}? explain step by step."
                          f"<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False) for i in range(args.prompts)]
    sampling = SamplingParams(temperature=1.0, top_k=4, max_tokens=args.max_tokens, seed=args.seed)
    engine = engine_for(tok.decode([frequent_token(model, tok, prompts, sampling, args.tag_rank)]))
    runs = {"kv": engine.generate, "reprefill": engine.generate_reprefill}
    times: dict[str, list[float]] = {k: [] for k in runs}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in runs.items():  # alternating, so drifting load hits both alike
            start = time.perf_counter()
            outputs[name] = fn(prompts, args.n, sampling)
            times[name].append(time.perf_counter() - start)
    same = all(a.token_ids == b.token_ids for ga, gb in zip(outputs["kv"], outputs["reprefill"]) for a, b in zip(ga, gb))
    rows = [o for group in outputs["kv"] for o in group]
    sampled = sum(sum(o.response_mask) for o in rows)
    total = sum(len(o.token_ids) for o in rows)
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": torch.get_num_threads(),
              "args": {k: v for k, v in vars(args).items() if k != "out"},
              "loadavg_before": os.getloadavg()[0], "samples": len(rows), "sampled_tokens": sampled,
              "response_tokens": total, "tool_calls": sum(o.tool_call_num for o in rows),
              "identical_trajectories": same, "repeats": args.repeats}
    for name in runs:
        med = statistics.median(times[name])
        result[name] = {"median_s": round(med, 3), "runs_s": [round(t, 3) for t in times[name]],
                        "sampled_tokens_per_s": round(sampled / med, 1), "response_tokens_per_s": round(total / med, 1)}
    result["speedup_kv_over_reprefill"] = round(statistics.median(times["reprefill"]) / statistics.median(times["kv"]), 2)
    result["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))
    if args.out:
        path = Path(args.out)
        history = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(history + [result], indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
