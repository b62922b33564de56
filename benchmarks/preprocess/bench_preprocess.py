"""Preprocessing throughput (rows/s) on synthetic chain-sum rows, workers=1 and workers=2.

    .venv/bin/python benchmarks/preprocess/bench_preprocess.py --rows 100000 --repeats 3

Builds a local byte-level BPE tokenizer (vocab 4096, trained on the synthetic text; no downloads),
writes the rows as JSONL, then runs ``posttrain.data.preprocess.preprocess`` with the qwen_r1
template and the R1 handler (the GRPO path) and, with ``--sft``, the SFT handler. Rows/s counts
reading, tokenising and writing (not imports and tokenizer loading; see PreprocessSummary).
Prints the median over repeats, as wall-clock rows/s and as rows per CPU-second (less
sensitive to a shared, loaded machine). This is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path


def synthetic_rows(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        terms = [rng.randint(1, 999) for _ in range(rng.randint(3, 12))]
        problem = ("Compute the chain sum step by step and give the final total. "
                   + " + ".join(map(str, terms)) + " = ?")
        yield {"problem": problem, "answer": str(sum(terms))}


def build_tokenizer(out: Path) -> str:
    from posttrain.models.init_model import default_corpus, train_tokenizer

    texts = default_corpus(2000) + [r["problem"] for r in synthetic_rows(5000, seed=1)]
    train_tokenizer(texts, 4096).save_pretrained(str(out))
    return str(out)


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the pool workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_once(data: str, tok: str, out: str, workers: int, handler: str, prompt_type: str) -> tuple[float, int]:
    from posttrain.data.preprocess import preprocess

    cfg = dict(input=data, handler_name=handler, prompt_type=prompt_type, tokenizer_name_or_path=tok,
               output_prefix=out, workers=workers, map_keys={"prompt": "problem", "query": "", "response": "answer"},
               dataset_additional_keys=["labels"] if handler.startswith("R1") else [])
    summary = preprocess(cfg, progress=False)
    return summary.rows_read / summary.seconds, summary.rows_written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sft", action="store_true", help="also time the SFT handler")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = build_tokenizer(tmp / "tok")
        data = tmp / "rows.jsonl"
        with open(data, "w") as f:
            for row in synthetic_rows(args.rows):
                f.write(json.dumps(row) + "\n")
        cases = [("R1AlpacaStyleInstructionHandler", "qwen_r1")]
        if args.sft:
            cases.append(("AlpacaStyleInstructionHandler", "qwen"))
        print(f"{args.rows} synthetic rows, {os.cpu_count()} CPUs visible (shared machine: numbers are noisy)")
        for handler, template in cases:
            for workers in args.workers:
                rates, cpu_rates = [], []
                for r in range(args.repeats):
                    t, cpu = time.perf_counter(), cpu_seconds()
                    rate, written = run_once(str(data), tok, str(tmp / f"out{workers}_{r}" / "d"), workers, handler, template)
                    cpu = cpu_seconds() - cpu
                    rates.append(rate)
                    cpu_rates.append(args.rows / cpu)
                    print(f"  {handler} workers={workers} repeat {r}: {rate:,.0f} rows/s wall, "
                          f"{args.rows / cpu:,.0f} rows per CPU-second "
                          f"({written} written, {time.perf_counter() - t:.1f} s with setup)", flush=True)
                print(f"{handler} / {template}, workers={workers}: median {statistics.median(rates):,.0f} rows/s "
                      f"(wall), {statistics.median(cpu_rates):,.0f} rows per CPU-second (incl. setup), "
                      f"over {args.repeats} repeats")


if __name__ == "__main__":
    main()
