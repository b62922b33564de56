"""``posttrain score``: run named verifiers over a JSONL file of responses and labels.

Each input line ``{"response": ..., "label": ...}`` (field names set by ``--response-field`` /
``--label-field``; an optional ``prompt`` field is passed to verifiers that take it) is written
back unchanged plus ``"scores": {NAME: value, ...}``. A summary follows: mean score per
verifier, timeouts and errors.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

from posttrain.commands.outputs import check_output_file
from posttrain.files import write_atomic
from posttrain.data.readers import iter_jsonl
from posttrain.errors import ConfigError, DataError
from posttrain.reward.rule_reward import RuleReward
from posttrain.reward.verifiers import VERIFIERS

BATCH_LINES = 2048


def read_rows(path: Path, response_field: str, label_field: str) -> list[dict]:
    """Parsed lines; a malformed line or a missing field raises DataError naming the line."""
    check_utf8(path)
    rows = []
    for row, where in iter_jsonl(path):
        for field in (response_field, label_field):
            if field not in row:
                raise DataError(f"{where}: no field {field!r} (keys: {', '.join(row)}); "
                                f"use --response-field / --label-field")
            if row[field] is None:
                raise DataError(f"{where}: the field {field!r} is null; give it a value (text), or leave the row out")
        rows.append(row)
    if not rows:
        raise DataError(f"--input {path}: no rows (the file has no JSON object lines); nothing to score")
    return rows


def check_utf8(path: Path) -> None:
    """DataError naming the file, line and byte of the first line that is not UTF-8 (JSON Lines
    are UTF-8; a replacement character would silently change the response being scored)."""
    if not path.is_file():
        return  # the reader reports a missing file
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{line[err.start]:02x} at column "
                                f"{err.start + 1}); convert the file to UTF-8") from None


def _json_line(row: dict) -> bytes:
    """One JSONL line; a string holding a lone surrogate (valid JSON ``"\\udc80"``, not encodable
    as UTF-8) is written with ``\\u`` escapes, so it reads back as the same string."""
    line = json.dumps(row, ensure_ascii=False) + "\n"
    try:
        return line.encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(row) + "\n").encode("ascii")


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def score_rows(rows: list[dict], names: list[str], response_field: str, label_field: str, *,
               parallel: int = 1, timeout: float = 30.0, modules=()) -> dict:
    """Add ``scores`` to every row in place; returns the summary counts."""
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
    """Write rows atomically (temporary file, then rename; no temporary is left on failure)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(f) -> None:
        for row in rows:
            f.write(_json_line(row))

    write_atomic(path, write)


def print_summary(summary: dict) -> None:
    print(f"scored {summary['count']} lines")
    width = max(len(n) for n in summary["mean"]) if summary["mean"] else 8
    print(f"{'verifier':<{width}}  {'mean':>8}  {'timeouts':>8}  {'errors':>6}")
    for n, mean in summary["mean"].items():
        print(f"{n:<{width}}  {mean:>8.4f}  {summary['timeouts'][n]:>8d}  {summary['errors'][n]:>6d}")
    for msg in summary["messages"]:
        print(f"  e.g. {msg}")


def check_args(args) -> None:
    """The flags' values, checked before any work; each message names its flag."""
    for mod in args.verifier_module:
        try:
            importlib.import_module(mod)
        except ImportError as err:
            raise ConfigError(f"--verifier-module {mod}: cannot import it ({err}); make it importable (install "
                              f"the package or add its folder to PYTHONPATH)") from None
    for name in args.verifier:
        if name not in VERIFIERS:
            raise ConfigError(f"--verifier {name}: unknown verifier; known: {', '.join(VERIFIERS.names())}. A verifier "
                              f"of your own must be registered with @register_verifier in a module given with "
                              f"--verifier-module")
    if args.parallel < 0:
        raise ConfigError(f"--parallel {args.parallel}: must be >= 0 (0 scores in this process)")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout}: must be a finite number of seconds > 0")


def run(args) -> int:
    check_args(args)
    # before the work: an output problem must not cost the scoring (rewriting --input in place is fine)
    check_output_file(args.output, "--output", force=bool(getattr(args, "force", False)), same_as=args.input)
    rows = read_rows(Path(args.input), args.response_field, args.label_field)
    summary = score_rows(rows, list(args.verifier), args.response_field, args.label_field,
                         parallel=args.parallel, timeout=args.timeout, modules=args.verifier_module)
    write_jsonl(rows, Path(args.output))
    print_summary(summary)
    print(f"wrote {args.output}")
    return 0
