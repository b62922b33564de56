"""The update step with freed memory kept in the process (``posttrain.host_memory``) against glibc's
behaviour, interleaved in one process.

    PYTHONPATH=src python benchmarks/host_memory.py [--threads 1] [--repeats 8]

The workload is ``update_compile.py``'s: the update of issue 22's chat workload (SmolLM2-135M-Instruct
in fp32, 8 prompts x 8 samples packed with shared prefixes, the chunked LM head at temperature 0.5,
the fp32 linear kernel a run would choose, fused AdamW, ``zero_grad(set_to_none=True)``). Steps
alternate between the two settings, so a change of the machine's speed falls on both:

* ``keep``: :data:`posttrain.host_memory.KEEP` (no mmap for large blocks, no trim under 2 GiB free);
* ``glibc``: glibc's defaults as a process that has run a while holds them: blocks over 32 MiB
  mapped on their own and returned on free, the heap's top trimmed beyond 64 MiB free (glibc raises
  its thresholds to these as large blocks are freed; setting them here freezes them), and the free
  memory returned (``malloc_trim``) when switching to it.

Per setting: the median step time, the median of the per-pair ratios, and the minor page faults of
a step (``getrusage``). Records the CPU model, threads, linear kernel and the cores other processes
used (``/proc/stat``).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from update_compile import chat_batch, cpu_model, load, make_step  # noqa: E402

from posttrain.commands.bench import CpuMeter  # noqa: E402
from posttrain.host_memory import DEFAULTS, KEEP, M_TRIM_THRESHOLD, glibc  # noqa: E402
from posttrain.models.cpu_linear import resolve_cpu_linear, set_cpu_linear  # noqa: E402

M_MMAP_THRESHOLD = -3
GLIBC_WARM = {**DEFAULTS, M_MMAP_THRESHOLD: 32 * 1024 * 1024, M_TRIM_THRESHOLD: 64 * 1024 * 1024}


def settle(libc, setting: str) -> None:
    for param, value in (KEEP if setting == "keep" else GLIBC_WARM).items():
        libc.mallopt(param, value)
    if setting == "glibc":
        libc.malloc_trim(0)


def measured(step) -> tuple[float, int]:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    step()
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--model", default="smollm2")
    args = p.parse_args()
    libc = glibc()
    if libc is None:
        raise SystemExit("glibc's mallopt is needed (Linux with glibc)")
    torch.set_num_threads(args.threads)
    kernel = resolve_cpu_linear("cpu")
    set_cpu_linear(kernel)
    model = load(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
    step = make_step(model, chat_batch(model.config.vocab_size), optimizer, train=True)
    print(f"{cpu_model()}; {args.threads} threads; torch {torch.__version__}; fp32 linear {kernel}; load "
          f"{Path('/proc/loadavg').read_text().strip()}", flush=True)
    for setting in ("glibc", "keep"):  # one warm-up step each
        settle(libc, setting)
        step()
    results: dict[str, list[tuple[float, int]]] = {"glibc": [], "keep": []}
    with CpuMeter() as meter:
        for rnd in range(args.repeats):
            for setting in (("glibc", "keep") if rnd % 2 == 0 else ("keep", "glibc")):
                settle(libc, setting)
                step()  # the first step after a switch pays the switch (trim, or a heap grown anew)
                results[setting].append(measured(step))
            print(f"round {rnd}: " + ", ".join(f"{s} {r[-1][0]:.2f} s ({r[-1][1]} faults)" for s, r in results.items()),
                  flush=True)
    ratios = [g[0] / k[0] for g, k in zip(results["glibc"], results["keep"])]
    for setting, rows in results.items():
        print(f"{setting:<6} median step {statistics.median(r[0] for r in rows):.2f} s, "
              f"{statistics.median(r[1] for r in rows):.0f} page faults a step")
    print(f"glibc / keep: {statistics.median(ratios):.3f}x (median of {len(ratios)} pairs; "
          f"{' '.join(f'{x:.2f}' for x in ratios)}); others' cores {meter.result['others_cores']:.2f}; load "
          f"{Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
