"""Preference pairs for DPO on the tiny pipeline: the right sum preferred over an off-by-one sum.

Writes <out>/pairs.jsonl with {"problem", "chosen", "rejected"} rows over the same 25 additions
as examples/tiny/make_data.py (the SFT warm start answers about half of them right).

    python examples/tiny/make_pairs.py runs/tiny/raw
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

MAX_TERM = 4


def main(out: str, count: int = 2000, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, MAX_TERM), rng.randint(0, MAX_TERM)
        wrong = a + b + rng.choice((-1, 1))
        rows.append({"problem": f"What is {a} + {b}?", "chosen": f"<answer>{a + b}</answer>",
                     "rejected": f"<answer>{wrong}</answer>"})
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny/raw")
