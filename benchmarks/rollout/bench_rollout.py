"""Rollout throughput: posttrain's native engine vs Hugging Face ``model.generate`` in the same run.

Workload (issue 5): 8 prompts x n=8 samples x 64 new tokens, the seed's sampling defaults
(temperature 0.2, top_k 50, top_p 1.0). Random-init models rarely emit eos, so by default no stop
tokens are given to either engine and every sample runs the full 64 tokens (equal work);
``--mixed`` adds a stop-token set so samples end at different lengths.

    .venv/bin/python benchmarks/rollout/bench_rollout.py --model tiny_qwen2 --repeats 5
    .venv/bin/python benchmarks/rollout/bench_rollout.py --model smollm2_135m --repeats 3 --dtypes float32 bfloat16

Reports the median over repeats of generated tokens/s, the ratio native / HF, and the achieved
FLOP/s (model FLOPs per generated token x tokens/s) against a measured matmul peak.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

MODELS = {
    # mirrors configs/model/tiny_qwen2.yaml
    "tiny_qwen2": lambda: _qwen2(vocab=320, hidden=384, layers=6, heads=6, kv=2, ffn=1024),
    # SmolLM2-135M architecture, random init, full 49152 vocab
    "smollm2_135m": lambda: _llama(vocab=49152, hidden=576, layers=30, heads=9, kv=3, ffn=1536),
}


def _qwen2(vocab, hidden, layers, heads, kv, ffn):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                      max_position_embeddings=2048)
    return Qwen2ForCausalLM(cfg)


def _llama(vocab, hidden, layers, heads, kv, ffn):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                      max_position_embeddings=8192, rope_theta=100000.0)
    return LlamaForCausalLM(cfg)


def flops_per_token(model, context: int) -> float:
    """2 x (matmul params, lm head included, embedding lookup excluded) + 4 x layers x hidden x context."""
    cfg = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        params += cfg.vocab_size * cfg.hidden_size
    return 2.0 * params + 4.0 * cfg.num_hidden_layers * cfg.hidden_size * context


def matmul_peak(dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        times.append((time.perf_counter() - t0) / 4)
    return 2 * size ** 3 / statistics.median(times[1:])


def make_prompts(num, vocab, rng, lo=24, hi=64):
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=rng)),), generator=rng).tolist()
            for _ in range(num)]


def run_native(model, prompts, n, new_tokens, dtype, stops, seed):
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=[], dtype=dtype)
    sampling = SamplingParams(max_tokens=new_tokens, seed=seed)  # the seed's defaults otherwise
    outs = engine.generate(prompts, n, sampling, stop_token_ids=stops)
    return sum(len(o.token_ids) for group in outs for o in group)


def run_hf(model, prompts, n, new_tokens, dtype, stops, seed):
    torch.manual_seed(seed)
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else contextlib.nullcontext())
    with torch.inference_mode(), ctx:
        out = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=n, do_sample=True,
                             max_new_tokens=new_tokens, temperature=0.2, top_k=50, top_p=1.0,
                             eos_token_id=stops or None, pad_token_id=0)
    resp = out[:, length:]
    if not stops:
        return resp.numel()
    is_stop = torch.isin(resp, torch.tensor(stops))
    first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full((resp.shape[0],), resp.shape[1]))
    return int(first.sum())


def bench(args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = MODELS[args.model]().eval()
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(1)
    prompts = make_prompts(args.prompts, vocab, rng)
    stops = sorted(torch.randperm(vocab - 3, generator=rng)[: max(1, vocab // 50)].add(3).tolist()) if args.mixed else []
    ctx = statistics.mean(len(p) for p in prompts) + args.new_tokens / 2
    fpt = flops_per_token(model, int(ctx))
    print(f"model={args.model} params={sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"workload={args.prompts}x{args.n}x{args.new_tokens} mixed={args.mixed} threads={args.threads} "
          f"GFLOP/token={fpt / 1e9:.3f}", flush=True)
    for dtype in args.dtypes:
        peak = matmul_peak(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        engines = (("hf_generate", run_hf), ("native", run_native))
        for _, fn in engines:
            fn(model, prompts[:2], 2, 4, dtype, stops, 0)  # warm-up
        rates = {name: [] for name, _ in engines}
        toks = {name: [] for name, _ in engines}
        for r in range(args.repeats):  # interleaved, so both engines see the same machine load
            for name, fn in engines:
                t0 = time.perf_counter()
                tokens = fn(model, prompts, args.n, args.new_tokens, dtype, stops, 100 + r)
                rates[name].append(tokens / (time.perf_counter() - t0))
                toks[name].append(tokens)
                print(f"    repeat {r} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
        for name, _ in engines:
            med = statistics.median(rates[name])
            print(f"  {dtype:9s} {name:12s} tokens/s median={med:8.1f} "
                  f"runs={[round(x, 1) for x in rates[name]]} tokens/run={statistics.median(toks[name]):.0f} "
                  f"GFLOP/s={med * fpt / 1e9:6.1f} ({100 * med * fpt / peak:4.1f}% of "
                  f"matmul peak {peak / 1e9:.1f} GFLOP/s)")
        ratios = [a / b for a, b in zip(rates["native"], rates["hf_generate"])]
        print(f"  {dtype:9s} speedup native/hf: median of per-repeat ratios = {statistics.median(ratios):.2f}x "
              f"{[round(x, 2) for x in ratios]}", flush=True)

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny_qwen2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--mixed", action="store_true", help="add stop tokens (~2%% of the vocab): mixed lengths")
    bench(parser.parse_args())


if __name__ == "__main__":
    main()
