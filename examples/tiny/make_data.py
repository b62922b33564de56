"""Data for the tiny pipeline: single-digit additions ("What is 3 + 4?" -> "7").

Writes <out>/sft.jsonl (instruction/output pairs answering "<answer>N</answer>"), <out>/train.jsonl and
<out>/test.jsonl (problem/answer rows for RL and held-out evaluation; the test problems never appear in
train or SFT data).

    python examples/tiny/make_data.py runs/tiny/raw
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def main(out: str, seed: int = 0) -> None:
    problems = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(problems)
    test, train = problems[:20], problems[20:]
    rng = random.Random(seed + 1)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def rows(pairs, n):
        return [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in (rng.choice(pairs) for _ in range(n))]

    sft = [{"instruction": r["problem"], "output": f"<answer>{r['answer']}</answer>"} for r in rows(train, 3000)]
    for name, data in (("sft", sft), ("train", rows(train, 1000)),
                       ("test", [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in test])):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny/raw")
