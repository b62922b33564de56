"""Baseline evaluation of SmolLM2-135M-Instruct on the demo's chain-sum task.

Greedy accuracy on held-out problems (``--n 1``), or sampled groups (``--n 8 --temperature 0.7``)
to measure the fraction of groups with mixed rewards. Examples::

    python examples/demo/baseline_eval.py --num-terms 4 --max-value 9 --num-test 100
    python examples/demo/baseline_eval.py --num-test 48 --n 8 --temperature 1.0
    python examples/demo/baseline_eval.py --model ckpt/hf --data test.jsonl   # after training
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or local HF dir")
    p.add_argument("--data", help="JSONL with prompt/answer rows (default: generate the test split)")
    p.add_argument("--num-test", type=int, default=100)
    p.add_argument("--num-terms", type=int, default=4)
    p.add_argument("--min-value", type=int, default=1)
    p.add_argument("--max-value", type=int, default=9)
    p.add_argument("--allow-negative", action="store_true")
    p.add_argument("--style", default="boxed", help="prompt style: plain, boxed, answer_is")
    p.add_argument("--system", default=None, help="system prompt (default: the template's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--scorer", default="demo", help="demo, demo_lenient, or a posttrain.reward verifier")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--show", type=int, default=3, help="print this many example responses")
    p.add_argument("--out", help="write per-response records to this JSONL file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from demo_eval import evaluate, load_model
    from demo_scoring import get_scorer
    from posttrain.data.readers import read_jsonl
    from posttrain.demo.pretrained import resolve_model
    from posttrain.demo.tasks import make_splits, write_jsonl

    if args.data:
        rows = read_jsonl(args.data, strict=True)[: args.num_test]
    else:
        _, rows = make_splits(0, args.num_test, args.seed, num_terms=args.num_terms,
                              min_value=args.min_value, max_value=args.max_value,
                              allow_negative=args.allow_negative, style=args.style)
    model, tokenizer = load_model(resolve_model(args.model), threads=args.threads)
    result = evaluate(model, tokenizer, rows, max_new_tokens=args.max_new_tokens,
                      batch_size=args.batch_size, n=args.n, temperature=args.temperature,
                      system=args.system, dtype=args.dtype, scorer=get_scorer(args.scorer),
                      seed=args.seed)
    for rec in result.records[: args.show]:
        print(f"--- {rec['problem']} = {rec['answer']}  reward={rec['reward']}\n{rec['response']}")
    print(json.dumps({"args": vars(args), **result.summary()}))
    if args.out:
        write_jsonl(result.records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
