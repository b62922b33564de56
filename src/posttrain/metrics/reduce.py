"""Collect per-step metric values during an iteration and reduce them to one number per key.

Reduction rules (seed section 6.1, first match wins; see docs/metrics.md):

==========================  =========================================================
key                         reduction of the collected values ``v_1 .. v_k``
==========================  =========================================================
``timing/*resharding*``     ``max(v)`` (longest single resharding)
``timing/*`` as pairs       ``max(end) - min(start)`` over ``(end, start)`` pairs (span)
``timing/*`` as numbers     ``sum(v)`` (posttrain: sequential chunks add up)
``start_time/*``            ``min(v)``
``end_time/*``              ``max(v)``
``*/max``                   ``max(v)`` (posttrain; the seed takes the mean)
``*/min``                   ``min(v)`` (posttrain; the seed takes the mean)
anything else               ``mean(v)`` (losses over micro-batches, rewards over samples...)
==========================  =========================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

Reduction = Callable[[str, list], float]


def _flat(values: list) -> list[float]:
    out: list[float] = []
    for v in values:
        out.extend(_flat(list(v)) if isinstance(v, (list, tuple)) else [float(v)])
    return out


def _timing(key: str, values: list) -> float:
    """Span of the ``(end, start)`` pairs plus the sum of plain durations."""
    pairs = [v for v in values if isinstance(v, (list, tuple))]
    durations = [float(v) for v in values if not isinstance(v, (list, tuple))]
    span = max(_flat(pairs)) - min(_flat(pairs)) if pairs else 0.0
    return span + math.fsum(durations)


REDUCTIONS: list[tuple[str, Callable[[str], bool], Reduction]] = [
    ("timing_resharding", lambda k: "timing" in k and "resharding" in k, lambda k, v: max(_flat(v))),
    ("timing_span", lambda k: "timing" in k, _timing),
    ("start_time", lambda k: k.startswith("start_time/"), lambda k, v: min(_flat(v))),
    ("end_time", lambda k: k.startswith("end_time/"), lambda k, v: max(_flat(v))),
    ("max", lambda k: k.endswith("/max"), lambda k, v: max(_flat(v))),
    ("min", lambda k: k.endswith("/min"), lambda k, v: min(_flat(v))),
    ("mean", lambda k: True, lambda k, v: math.fsum(_flat(v)) / len(_flat(v))),
]


def reduce_values(key: str, values: list) -> float:
    """Reduce the values collected for ``key`` with the first matching rule of :data:`REDUCTIONS`."""
    for _, matches, reduce in REDUCTIONS:
        if matches(key):
            return float(reduce(key, values))
    raise AssertionError("the last rule matches every key")


def to_float(value: Any) -> float:
    """A Python float from a number, 0-d/1-element tensor or numpy scalar."""
    if hasattr(value, "item"):
        return float(value.item())
    return float(value)


def _items(key: str, value: Any) -> list:
    if hasattr(value, "tolist") and not isinstance(value, (int, float)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return [float(value)]
    if "timing" in key:
        if len(value) == 2 and not isinstance(value[0], (list, tuple)):
            return [tuple(float(x) for x in value)]
        return [tuple(float(x) for x in pair) if isinstance(pair, (list, tuple)) else float(pair)
                for pair in value]
    return _flat(list(value))


class MetricAccumulator:
    """``add``/``update`` values during an iteration, ``reduce()`` at its end (seed ``Metric``).

    ``update(d, cumulate=True)`` appends (lists are extended); ``cumulate=False`` replaces.
    Timing keys take ``(end, start)`` pairs like the seed, or plain durations.
    """

    def __init__(self) -> None:
        self._values: dict[str, list] = {}

    def add(self, key: str, value: Any) -> None:
        """Append ``value``: a number, a list of numbers, or for timing keys an ``(end, start)``
        pair or a list of pairs."""
        self._values.setdefault(key, []).extend(_items(key, value))

    def update(self, metrics: Mapping[str, Any], cumulate: bool = True) -> None:
        for key, value in metrics.items():
            if not cumulate:
                self._values.pop(key, None)
            self.add(key, value)

    def reduce(self) -> dict[str, float]:
        """One float per key, then start_time/* and end_time/* dropped (seed: popped)."""
        out = {k: reduce_values(k, v) for k, v in self._values.items() if v}
        return {k: v for k, v in out.items() if not k.startswith(("start_time/", "end_time/"))}

    def raw(self) -> dict[str, list]:
        return {k: list(v) for k, v in self._values.items()}

    def merge(self, other: "MetricAccumulator") -> None:
        """Append every value ``other`` collected (as if it had been added here)."""
        for key, values in other.raw().items():
            self._values.setdefault(key, []).extend(values)

    def reset(self) -> None:
        self._values.clear()


PRINT_ORDER = ("timing/all", "timing/update", "timing/rollout", "timing/old_log_p",
               "timing/reference_model", "timing/resharding_to_infer", "timing/resharding_to_train",
               "timing/adv", "timing/non_overlap_reference_model")
SPECIAL_TIMINGS = ("timing/non_overlap_rule_reward", "timing/non_overlap_reward_model",
                   "timing/non_overlap_adv", "timing/rule_reward", "timing/reward_model",
                   "timing/ref_onload", "timing/ref_offload", "timing/critic_model",
                   "timing/update_critic")


def sort_metrics(metrics: Mapping[str, float], first: Iterable[str] = PRINT_ORDER + SPECIAL_TIMINGS,
                 ) -> dict[str, float]:
    """The seed's print order: fixed timing keys first, then the rest sorted by name."""
    head = [k for k in first if k in metrics]
    rest = sorted(k for k in metrics if k not in set(head))
    return {k: metrics[k] for k in head + rest}
