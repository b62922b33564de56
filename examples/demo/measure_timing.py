"""MEASUREMENT SCRIPT (not product code): time the pieces of one GRPO iteration on this CPU.

* rollout: ``prompts x n`` sampled responses of exactly ``max_new_tokens`` tokens with HF
  ``generate`` (eos disabled so every run does the same work), batched in one call;
* update: one forward + backward of the policy on ``prompts * n`` sequences of
  ``prompt_len + max_new_tokens`` tokens (mean log-prob loss), optionally in micro-batches.

Prints wall and process-CPU seconds (median of ``--repeats``) for fp32 and bf16 autocast.
Wall time on a shared machine is noisy; CPU time / threads approximates an idle machine::

    python examples/demo/measure_timing.py --prompts 8 --n 8 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _timed(fn, repeats):
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return round(statistics.median(walls), 2), round(statistics.median(cpus), 2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--skip", default="", help="comma list of phases to skip: rollout,update")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    from demo_eval import autocast, load_model
    from posttrain.demo.pretrained import resolve_model

    model, tok = load_model(resolve_model(args.model), threads=args.threads)
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(100, 40000, (args.prompts, args.prompt_len), generator=g)
    seqs = torch.randint(100, 40000, (args.prompts * args.n, args.prompt_len + args.max_new_tokens),
                         generator=g)
    results = []
    for dtype in args.dtypes.split(","):
        row = {"dtype": dtype, "prompts": args.prompts, "n": args.n,
               "max_new_tokens": args.max_new_tokens, "prompt_len": args.prompt_len}

        def rollout():
            model.eval()
            with torch.inference_mode(), autocast(dtype):
                model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                               do_sample=True, temperature=1.0, top_k=0,
                               num_return_sequences=args.n, max_new_tokens=args.max_new_tokens,
                               min_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)

        def update():
            model.train()
            for lo in range(0, seqs.shape[0], args.micro_batch):
                mb = seqs[lo:lo + args.micro_batch]
                with autocast(dtype):
                    # logits only for the response positions: skips the lm_head on prompt tokens
                    keep = args.max_new_tokens + 1
                    logits = model(input_ids=mb, logits_to_keep=keep).logits[:, :-1].float()
                logp = torch.log_softmax(logits, -1).gather(-1, mb[:, args.prompt_len:, None])
                logp.mean().backward()
            model.zero_grad(set_to_none=True)

        if "rollout" not in args.skip:
            row["rollout_wall_s"], row["rollout_cpu_s"] = _timed(rollout, args.repeats)
        if "update" not in args.skip:
            row["update_wall_s"], row["update_cpu_s"] = _timed(update, args.repeats)
        print(json.dumps(row), flush=True)
        results.append(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
