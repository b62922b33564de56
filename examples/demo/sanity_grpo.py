"""MEASUREMENT SCRIPT, NOT THE PRODUCT: a throwaway GRPO-like loop in plain PyTorch + HF generate.

It answers one question for the real demo: does held-out greedy accuracy of SmolLM2-135M-Instruct
move on the chain-sum task within a few minutes on this CPU, and at which learning rate?
posttrain's real GRPO trainer lives in ``posttrain.loops``; do not build on this file.

Per step: ``prompts`` train problems x ``n`` samples (temperature ``T``), 0/1 rewards,
group-normalised advantages ``A_i = (r_i - mean(r)) / (std(r) + 1e-6)`` (groups with equal rewards
get A = 0 and are dropped), on-policy policy-gradient loss
``L = -sum_{i,t} A_i * log pi(y_{i,t} | x, y_{i,<t}) / num_response_tokens``, one AdamW step::

    python examples/demo/sanity_grpo.py --steps 10 --lr 1e-5 --num-test 64
"""

from __future__ import annotations

import argparse
import json
import random
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-terms", type=int, default=2)
    p.add_argument("--max-value", type=int, default=9)
    p.add_argument("--style", default="answer_is")
    p.add_argument("--system", default=None)
    p.add_argument("--scorer", default="demo_lenient")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--num-test", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=0, help="0 = only before and after")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def response_mask(resp, eos_id):
    """1 for response tokens up to and including the first eos; [B, T]."""
    import torch

    is_eos = (resp == eos_id).int()
    before = torch.cumsum(is_eos, dim=1) - is_eos  # eos seen strictly before t
    return (before == 0).float()


def grpo_step(model, tok, opt, batch_rows, args, scorer, autocast):
    import torch

    from demo_eval import chat_prompts

    prompts = chat_prompts(tok, [r["prompt"] for r in batch_rows], args.system)
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.inference_mode(), autocast(args.dtype):
        out = model.generate(**enc, do_sample=True, temperature=args.temperature, top_k=0,
                             num_return_sequences=args.n, max_new_tokens=args.max_new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    out = out.clone()
    plen = enc["input_ids"].shape[1]
    resp = out[:, plen:]
    rmask = response_mask(resp, tok.eos_token_id)
    texts = tok.batch_decode(resp, skip_special_tokens=True)
    answers = [r["answer"] for r in batch_rows for _ in range(args.n)]
    rewards = torch.tensor([scorer(t, a) for t, a in zip(texts, answers)]).view(-1, args.n)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6))
    adv = adv.view(-1)
    keep = adv.abs() > 0
    stats = {"reward": rewards.mean().item(), "mixed": (rewards.std(1) > 0).float().mean().item(),
             "resp_len": rmask.sum(1).mean().item()}
    if not keep.any():
        return stats
    attn = torch.cat([enc["attention_mask"].repeat_interleave(args.n, 0), rmask.long()], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    idx = keep.nonzero().view(-1)
    num_tokens = rmask[idx].sum()
    model.train()
    opt.zero_grad(set_to_none=True)
    for lo in range(0, len(idx), args.micro_batch):
        mb = idx[lo:lo + args.micro_batch]
        with autocast(args.dtype):
            logits = model(input_ids=out[mb], attention_mask=attn[mb], position_ids=pos[mb],
                           logits_to_keep=resp.shape[1] + 1).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, resp[mb, :, None]).squeeze(-1)
        loss = -(adv[mb, None] * logp * rmask[mb]).sum() / num_tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return stats


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from demo_eval import autocast, evaluate, load_model
    from demo_scoring import get_scorer
    from posttrain.demo.pretrained import resolve_model
    from posttrain.demo.tasks import make_splits

    torch.manual_seed(args.seed)
    scorer = get_scorer(args.scorer)
    train, test = make_splits(args.steps * args.prompts, args.num_test, args.seed,
                              num_terms=args.num_terms, max_value=args.max_value, style=args.style)
    random.Random(args.seed).shuffle(train)
    model, tok = load_model(resolve_model(args.model))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    def held_out():
        r = evaluate(model, tok, test, max_new_tokens=args.max_new_tokens, batch_size=32,
                     system=args.system, dtype=args.dtype, scorer=scorer)
        return round(r.accuracy, 4)

    t0 = time.perf_counter()
    print(json.dumps({"step": 0, "test_acc": held_out(), "t": round(time.perf_counter() - t0)}),
          flush=True)
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        rows = train[(step - 1) * args.prompts: step * args.prompts]
        stats = grpo_step(model, tok, opt, rows, args, scorer, autocast)
        line = {"step": step, **{k: round(v, 3) for k, v in stats.items()},
                "step_s": round(time.perf_counter() - t, 1)}
        if step == args.steps or (args.eval_every and step % args.eval_every == 0):
            line["test_acc"] = held_out()
        line["t"] = round(time.perf_counter() - t0)
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
