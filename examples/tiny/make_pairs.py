"""Preference pairs for DPO on the tiny pipeline: the right sum preferred over a wrong one.

Writes <out>/pairs.jsonl with {"problem", "chosen", "rejected"} rows ("7+2" -> "9" over "6", "7",
"11" or "12") over the problems of examples/tiny/make_data.py (rendered "7+2=" by the tiny_math
template). The wrong sum is 2 or 3 away from the right one, never off by one: "a+1" and "a+2"
differ in one token that the SFT warm start barely reads, and an off-by-one rejection of one is
often the right answer of the other (a+1+1 = a+2), so off-by-one pairs mostly teach the tiny model
to contradict itself (measured: rewards/accuracies stalled near 0.85 after 60 steps).

    python examples/tiny/make_pairs.py runs/tiny/raw
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

FIRST, SECOND = range(10), (1, 2)  # as examples/tiny/make_data.py


def main(out: str, count: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    problems = [(a, b) for a in FIRST for b in SECOND]
    rows = []
    for _ in range(count):
        a, b = rng.choice(problems)
        wrong = rng.choice([a + b + d for d in (-3, -2, 2, 3) if a + b + d >= 0])
        rows.append({"problem": f"{a}+{b}", "chosen": str(a + b), "rejected": str(wrong)})
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny/raw")
