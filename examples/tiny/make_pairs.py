"""Preference pairs for DPO on the tiny pipeline: the right sum preferred over an off-by-one sum.

Writes <out>/pairs.jsonl with {"problem", "chosen", "rejected"} rows ("7+2" -> "9" over "8" or
"10") over the problems of examples/tiny/make_data.py (rendered "7+2=" by the tiny_math template).

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
        rows.append({"problem": f"{a}+{b}", "chosen": str(a + b), "rejected": str(a + b + rng.choice((-1, 1)))})
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny/raw")
