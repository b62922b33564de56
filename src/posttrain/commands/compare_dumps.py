"""``posttrain compare-dumps A B``: the first tensor whose statistics differ between two accuracy
dumps (``msprobe_config``, :mod:`posttrain.metrics.dumps`), in execution order; exit 1 when one
differs beyond ``--rtol`` / ``--atol``, 0 when the dumps agree (:mod:`posttrain.metrics.dump_compare`)."""

from __future__ import annotations

from posttrain.errors import PosttrainError
from posttrain.metrics.dump_compare import first_difference, load_dump


def run(args) -> int:
    if args.rtol < 0 or args.atol < 0:
        raise PosttrainError(f"--rtol {args.rtol} / --atol {args.atol}: tolerances must be >= 0")
    a, b = load_dump(args.dump_a), load_dump(args.dump_b)
    difference = first_difference(a, b, rtol=args.rtol, atol=args.atol)
    if difference is not None:
        print(difference.describe())
        return 1
    records = sum(len(rows) for rows in a.values())
    print(f"the dumps agree: {records} records in {len({step for step, _ in a})} step(s) within rtol={args.rtol}, "
          f"atol={args.atol}")
    return 0
