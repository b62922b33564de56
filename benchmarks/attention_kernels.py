"""The attention kernels of the chat workload on this CPU: which ATen kernel SDPA runs, and what the
alternatives cost (issue 43).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/attention_kernels.py [--repeats 15] [--only update]

Shapes: SmolLM2-135M (9 query heads, 3 key/value heads, head dim 64) at the chat workload of
``benchmarks/vs_trl`` (8 prompts x 8 samples, prompts of 54 tokens, answers of 6-64 tokens, one
micro-batch of 64 rows). The update's packed attention (:mod:`posttrain.training.remove_padding`)
runs one SDPA per block of rows of similar length (:func:`block_rows` on the workload's lengths);
the rollout's decode runs one query row per sample against the KV cache with a key-padding mask.

Variants, timed interleaved (A B C A B C ..., one call each, medians over ``--repeats``):

* ``bool``: the old packed path: causal & key-padding boolean mask, GQA by ``repeat_interleave``;
* ``float``: the same mask as an additive float mask (0 / -inf);
* ``causal``: ``is_causal=True`` and no mask (exact: a slot's keys are a prefix of its row, so a
  real query never sees a padding key; padding queries' outputs are discarded);
* ``causal+gqa``: the same with SDPA's ``enable_gqa=True`` instead of ``repeat_interleave``;
* ``...+fp32`` (bf16 only): q/k/v cast to fp32 for the SDPA, the output cast back to bf16;
* decode (one query row against the KV cache, with the key-padding mask): ``pack`` (what the rollout
  runs: transformers' ``pack_gqa``, the 3 query heads of a key/value head as 3 query rows, no copy),
  ``repeat`` (``repeat_interleave``), ``gqa`` (``enable_gqa=True``); without a mask (no row padded),
  ``nomask-gqa`` (transformers' path: ``enable_gqa``) and ``nomask-pack`` (posttrain's on a CPU).

``fwd`` times the forward alone (under ``no_grad``), ``fwd+bwd`` the forward and the backward of a
random output gradient. The kernel each variant dispatches to is read from ``torch.profiler``.
Prints the machine record (``benchmarks/machine_record.py``) and the load before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_record import load_average, machine  # noqa: E402

from posttrain.training.remove_padding import block_rows  # noqa: E402

HEADS, KV_HEADS, DIM = 9, 3, 64
PROMPT = 54
# answer lengths of the chat workload's update (bench.json: min 6, mean 9.5-14, max 64, 2-5% clipped)
ANSWERS = [64, 64] + [6 + (7 * i) % 15 for i in range(62)]
DECODE = [(64, 60), (64, 90), (16, 118)]  # (rows left, cache columns) of a few decode steps


def update_blocks() -> list[tuple[int, int]]:
    """(rows, width) of each packed attention block of the workload's update micro-batch."""
    lengths = [PROMPT + a for a in ANSWERS]
    return [(len(rows), max(lengths[r] for r in rows)) for rows in block_rows(lengths)]


def _sdpa(q, k, v, mask, causal, gqa, upcast):
    """SDPA of ``q [B, H, L, D]`` over ``k/v [B, H_kv, S, D]``; ``gqa``: ``True`` (``enable_gqa``), ``False``
    (``repeat_interleave``) or ``"pack"`` (one query row: Hugging Face's ``pack_gqa``, the query heads of a
    key/value head as its query rows)."""
    dtype = q.dtype
    if upcast and dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    if gqa == "pack":
        rows, heads, _, dim = q.shape
        out = F.scaled_dot_product_attention(q.reshape(rows, k.shape[1], -1, dim), k, v, attn_mask=mask)
        return out.reshape(rows, heads, 1, dim).to(dtype)
    if not gqa and k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    return out.to(dtype)


def block_inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 0):
    """q/k/v of one block (padding slots past each row's length) and its boolean mask."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS, width, DIM, generator=g).to(dtype).requires_grad_()
    k = torch.randn(rows, KV_HEADS, width, DIM, generator=g).to(dtype).requires_grad_()
    v = torch.randn(rows, KV_HEADS, width, DIM, generator=g).to(dtype).requires_grad_()
    lengths = torch.randint(max(1, width // 2), width + 1, (rows,), generator=g)
    lengths[0] = width
    valid = torch.arange(width)[None, :] < lengths[:, None]
    mask = torch.ones(width, width, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    return q, k, v, mask, valid


def update_variants(dtype: torch.dtype, mask: torch.Tensor) -> dict:
    """name -> (mask, is_causal, enable_gqa, upcast)."""
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    variants = {"bool": (mask, False, False, False), "float": (additive, False, False, False),
                "causal": (None, True, False, False), "causal+gqa": (None, True, True, False)}
    if dtype != torch.float32:
        variants.update({"bool+fp32": (mask, False, False, True), "causal+fp32": (None, True, False, True),
                         "causal+gqa+fp32": (None, True, True, True)})
    return variants


def decode_variants(dtype: torch.dtype, mask: torch.Tensor) -> dict:
    """``pack``: transformers' ``sdpa_attention_forward`` for one query row with a mask (a batch with
    padded rows); ``nomask-gqa``: its path without one (no row padded: prompts of one length), which
    ``enable_gqa`` runs; ``nomask-pack``: ``posttrain.models.cpu_attention.decode_sdpa``'s path then."""
    variants = {"pack": (mask, False, "pack", False), "repeat": (mask, False, False, False),
                "gqa": (mask, False, True, False), "nomask-gqa": (None, False, True, False),
                "nomask-pack": (None, False, "pack", False)}
    if dtype != torch.float32:
        variants.update({"pack+fp32": (mask, False, "pack", True), "gqa+fp32": (mask, False, True, True)})
    return variants


def kernel_of(fn) -> str:
    """The ATen SDPA kernels (and matmuls) that ``fn`` ran, by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name for e in prof.events()}
    picked = sorted(n for n in names if "scaled_dot_product" in n and n != "aten::scaled_dot_product_attention")
    if not picked:
        picked = sorted(n for n in names if n in ("aten::bmm", "aten::baddbmm", "aten::_softmax"))
    return ", ".join(n.replace("aten::", "") for n in picked)


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each callable, timed A B C A B C ... after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def update_case(rows, width, dtype, repeats, backward: bool) -> list[dict]:
    q, k, v, mask, _ = block_inputs(rows, width, dtype)
    grad = torch.randn(rows, HEADS, width, DIM).to(dtype)
    fns = {}
    for name, (m, causal, gqa, upcast) in update_variants(dtype, mask).items():
        def run(m=m, causal=causal, gqa=gqa, upcast=upcast):
            if backward:
                q.grad = k.grad = v.grad = None
                _sdpa(q, k, v, m, causal, gqa, upcast).backward(grad)
            else:
                with torch.no_grad():
                    _sdpa(q, k, v, m, causal, gqa, upcast)
        fns[name] = run
    medians = interleaved(fns, repeats)
    return [{"case": f"update {'fwd+bwd' if backward else 'fwd'} [{rows}, {width}]", "dtype": str(dtype)[6:],
             "variant": name, "ms": 1e3 * s, "kernel": kernel_of(fns[name])} for name, s in medians.items()]


def decode_case(rows, columns, dtype, repeats) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(rows, HEADS, 1, DIM, generator=g).to(dtype)
    k = torch.randn(rows, KV_HEADS, columns, DIM, generator=g).to(dtype)
    v = torch.randn(rows, KV_HEADS, columns, DIM, generator=g).to(dtype)
    mask = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
    mask[:, :, :, : columns // 8] = False  # left padding of shorter prompts
    fns = {}
    for name, (m, causal, gqa, upcast) in decode_variants(dtype, mask).items():
        def run(m=m, causal=causal, gqa=gqa, upcast=upcast):
            with torch.inference_mode():
                _sdpa(q, k, v, m, causal, gqa, upcast)
        fns[name] = run
    medians = interleaved(fns, repeats)
    return [{"case": f"decode [{rows}, {columns}]", "dtype": str(dtype)[6:], "variant": name, "ms": 1e3 * s,
             "kernel": kernel_of(fns[name])} for name, s in medians.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--only", choices=["update", "decode"], default=None)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--output", default=None, help="JSON of every row")
    args = p.parse_args()
    print("machine", json.dumps(machine()))
    print("blocks (rows, width) of the update:", update_blocks())
    rows = []
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        if args.only in (None, "update"):
            for r, w in update_blocks():
                rows += update_case(r, w, dtype, args.repeats, backward=False)
                rows += update_case(r, w, dtype, args.repeats, backward=True)
        if args.only in (None, "decode"):
            for r, c in DECODE:
                rows += decode_case(r, c, dtype, args.repeats)
    base: dict = {}
    print("| case | dtype | variant | median ms | vs the first variant | kernel |\n|---|---|---|---|---|---|")
    for row in rows:
        ref = base.setdefault((row["case"], row["dtype"]), row["ms"])
        print(f"| {row['case']} | {row['dtype']} | {row['variant']} | {row['ms']:.2f} | {ref / row['ms']:.2f}x "
              f"| {row['kernel']} |")
    print("load average after", load_average())
    if args.output:
        Path(args.output).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
