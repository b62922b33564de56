"""Compare two accuracy dumps (:mod:`posttrain.metrics.dumps`): the first tensor whose statistics differ.

Both dumps are walked step by step (ascending), rank by rank, each step's records of every role in
the order they were computed (their ``seq``). The first record whose identity (role, phase, module
or tensor name, input/output, call, shape) differs, or one of whose statistics differs beyond the
tolerance (``|a - b| > atol + rtol * |b|``; NaN equals NaN; counts must be equal), is the answer.
Dumps that do not hold the same steps, ranks and roles cannot be compared: :class:`DumpError`.
No torch: the dumps are JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.metrics.dumps import STATS

IDENTITY = ("role", "phase", "name", "tensor", "call", "shape")
Key = tuple[int, int]  # (step, rank)


class DumpError(PosttrainError):
    """A dump that is missing, unreadable or not comparable with the other."""


@dataclass(frozen=True)
class Difference:
    """Where two dumps part: ``a`` and ``b`` are the records there (None: that dump has no more);
    ``stat`` the statistic that differs (None: the records themselves differ)."""

    step: int
    rank: int
    a: dict | None
    b: dict | None
    stat: str | None = None

    def describe(self) -> str:
        where = f"step {self.step}, rank {self.rank}"
        if self.stat is None:
            return (f"first difference: {where}: the dumps record different tensors here\n  A: {_label(self.a)}\n"
                    f"  B: {_label(self.b)}")
        return (f"first difference: {where}, {_label(self.a)}\n  statistic {self.stat}: A={self.a[self.stat]!r} "
                f"B={self.b[self.stat]!r}")


def _label(record: dict | None) -> str:
    if record is None:
        return "(no more records)"
    what = record["name"] + (f" {record['tensor']} (call {record['call']})" if "tensor" in record else "")
    return f"role {record['role']} (phase {record['phase'] or '-'}), {what}, shape {record['shape']}"


def load_dump(path: str | Path) -> dict[Key, list[dict]]:
    """``{(step, rank): records in execution order}`` of the dump folder ``path`` (``msprobe_config.dump_path``)."""
    root = Path(path)
    if not root.is_dir():
        raise DumpError(f"{path}: no such dump folder; give the dump_path of a run with msprobe_config.msprobe: true")
    dump: dict[Key, list[dict]] = {}
    for file in sorted(root.glob("step_*/rank_*/*.jsonl")):
        try:
            key = (int(file.parent.parent.name[5:]), int(file.parent.name[5:]))
        except ValueError:
            raise DumpError(f"{file}: not a dump file (expected step_<i>/rank_<r>/<role>.jsonl)") from None
        dump.setdefault(key, []).extend(_read_records(file))
    if not dump:
        raise DumpError(f"{path}: holds no step_<i>/rank_<r>/<role>.jsonl files; was the run's msprobe_config on "
                        f"with a *_dump switch within step_start..step_end?")
    return {key: sorted(rows, key=lambda r: r["seq"]) for key, rows in sorted(dump.items())}


def _read_records(file: Path) -> list[dict]:
    rows = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        try:
            row = json.loads(line)
            missing = [k for k in ("seq", "role", "name", *STATS) if k not in row]
        except (json.JSONDecodeError, TypeError):
            missing = ["a JSON object"]
        if missing:
            raise DumpError(f"{file}:{number}: not a dump record (missing {', '.join(missing)})")
        rows.append(row)
    return rows


def _roles(rows: list[dict]) -> set[str]:
    return {r["role"] for r in rows}


def check_comparable(a: dict[Key, list[dict]], b: dict[Key, list[dict]]) -> None:
    """Both dumps hold the same (step, rank) folders with the same roles, else :class:`DumpError`."""
    if a.keys() != b.keys():
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        raise DumpError(f"the dumps hold different steps or ranks (step, rank): only in A {only_a}, only in B "
                        f"{only_b}; dump the same msprobe_config.step_start..step_end in both runs")
    for key in a:
        if _roles(a[key]) != _roles(b[key]):
            raise DumpError(f"step {key[0]}, rank {key[1]}: A dumps the roles {sorted(_roles(a[key]))}, B "
                            f"{sorted(_roles(b[key]))}; turn on the same *_dump switches in both runs")


def close(x: Any, y: Any, rtol: float, atol: float) -> bool:
    if x is None or y is None or isinstance(x, int) and isinstance(y, int):
        return x == y
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(x - y) <= atol + rtol * abs(y)


def first_difference(a: dict[Key, list[dict]], b: dict[Key, list[dict]], *, rtol: float = 1e-5,
                     atol: float = 1e-8) -> Difference | None:
    """The first record where the dumps differ beyond the tolerance, or None when they agree."""
    check_comparable(a, b)
    for (step, rank), rows_a in a.items():
        rows_b = b[(step, rank)]
        for i in range(max(len(rows_a), len(rows_b))):
            x = rows_a[i] if i < len(rows_a) else None
            y = rows_b[i] if i < len(rows_b) else None
            if x is None or y is None or any(x.get(k) != y.get(k) for k in IDENTITY):
                return Difference(step, rank, x, y)
            stat = next((s for s in STATS if not close(x[s], y[s], rtol, atol)), None)
            if stat is not None:
                return Difference(step, rank, x, y, stat)
    return None
