"""``posttrain score``: run named verifiers over a JSONL file of responses and labels.

Each input line ``{"response": ..., "label": ...}`` (field names set by ``--response-field`` /
``--label-field``; an optional ``prompt`` field is passed to verifiers that take it) is written
back unchanged plus ``"scores": {NAME: value, ...}``. A summary follows: mean score per
verifier, timeouts and errors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.errors import DataError

BATCH_LINES = 2048


def read_jsonl(path: Path, response_field: str, label_field: str) -> list[dict]:
    """Parsed lines; a malformed line or a missing field raises DataError naming the line."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object")
            for field in (response_field, label_field):
                if field not in row:
                    raise DataError(f"{path}:{lineno}: no field {field!r} (keys: {', '.join(row)}); "
                                    f"use --response-field / --label-field")
            rows.append(row)
    return rows


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def score_rows(rows: list[dict], names: list[str], response_field: str, label_field: str, *,
               parallel: int = 1, timeout: float = 30.0, modules=()) -> dict:
    """Add ``scores`` to every row in place; returns the summary counts."""
    from posttrain.reward.rule_reward import RuleReward

    sums = {n: 0.0 for n in names}
    timeouts = {n: 0 for n in names}
    errors = {n: 0 for n in names}
    messages: list[str] = []
    with RuleReward(names, [1.0] * len(names), parallel, timeout, list(modules)) as rr:
        for start in range(0, len(rows), BATCH_LINES):
            batch = rows[start:start + BATCH_LINES]
            prompts = [_text(r.get("prompt", "")) for r in batch]
            res = rr.score_detailed([_text(r[response_field]) for r in batch],
                                    [_text(r[label_field]) for r in batch], prompts)
            for i, row in enumerate(batch):
                row["scores"] = {n: res.per_verifier[n][i] for n in names}
            for n in names:
                sums[n] += sum(res.per_verifier[n])
                timeouts[n] += sum(s == 1 for s in res.status[n])
                errors[n] += sum(s == 2 for s in res.status[n])
            messages.extend(m for m in res.errors if m not in messages)
    count = len(rows)
    return {"count": count, "mean": {n: (sums[n] / count if count else 0.0) for n in names},
            "timeouts": timeouts, "errors": errors, "messages": messages[:10]}


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write rows atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def print_summary(summary: dict) -> None:
    print(f"scored {summary['count']} lines")
    width = max(len(n) for n in summary["mean"]) if summary["mean"] else 8
    print(f"{'verifier':<{width}}  {'mean':>8}  {'timeouts':>8}  {'errors':>6}")
    for n, mean in summary["mean"].items():
        print(f"{n:<{width}}  {mean:>8.4f}  {summary['timeouts'][n]:>8d}  {summary['errors'][n]:>6d}")
    for msg in summary["messages"]:
        print(f"  e.g. {msg}")


def run(args) -> int:
    from posttrain.reward.verifiers import get_spec, import_verifier_modules

    import_verifier_modules(args.verifier_module)
    for name in args.verifier:
        get_spec(name)  # unknown names fail before any work
    rows = read_jsonl(Path(args.input), args.response_field, args.label_field)
    summary = score_rows(rows, list(args.verifier), args.response_field, args.label_field,
                         parallel=args.parallel, timeout=args.timeout, modules=args.verifier_module)
    write_jsonl(rows, Path(args.output))
    print_summary(summary)
    print(f"wrote {args.output}")
    return 0
