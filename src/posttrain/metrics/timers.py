"""Phase timers producing the seed's ``timing/*`` keys.

A phase is timed as a span ``(start, end)`` of wall-clock timestamps. A phase may run several
times in one iteration (chunks, DP ranks); its ``timing/<name>`` value is then the seed's
*span* reduction: ``max(end) - min(start)`` over all of its spans, i.e. the time from the first
start to the last end. ``resharding`` phases instead report the longest single duration.

The ``timing/non_overlap_*`` keys (seed section 6.1) say how much of a phase ran *after* the
actor's old-log-prob pass finished (the part that could not hide behind it)::

    non_overlap_reference_model = max(ref_end  - max(old_log_p_end, ref_start),  0)
    non_overlap_rule_reward     = max(rule_end - max(old_log_p_end, rule_start), 0)
    non_overlap_reward_model    = max(rm_end   - max(old_log_p_end, rm_start),   0)
    non_overlap_adv             = max(adv_end  - old_log_p_end, 0)

If old_log_p did not run, ``old_log_p_end := reference_model_end``; if neither ran,
``non_overlap_adv = timing/adv``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

Span = tuple[float, float]


def span_seconds(key: str, spans: list[Span]) -> float:
    """Reduce the spans of one timing key: longest duration for resharding, else last end - first start."""
    if "resharding" in key:
        return max(end - start for start, end in spans)
    return max(end for _, end in spans) - min(start for start, _ in spans)


class Timers:
    """Named phase timers for one iteration: ``with timers("rollout"): ...``.

    ``metrics()`` returns ``{"timing/rollout": seconds, ...}`` plus the non-overlap keys.
    A phase that raises is still recorded (its span ends at the exception).
    """

    def __init__(self, clock: Callable[[], float] = time.time, around: Callable[[str], Any] | None = None) -> None:
        self.clock = clock
        self.around = around  # a context manager around each phase (posttrain.metrics.profiler.RunProfiler.phase)
        self._spans: dict[str, list[Span]] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        from torch.profiler import record_function  # a named span when a profiler runs; lazy: no torch in metrics/

        start = self.clock()
        try:
            with (self.around(name) if self.around is not None else nullcontext()), \
                    record_function(name if name.startswith("timing/") else f"timing/{name}"):
                yield
        finally:
            self.record(name, start, self.clock())

    def record(self, name: str, start: float, end: float) -> None:
        """Add a span for phase ``name`` (``timing/`` is prefixed unless already there)."""
        key = name if name.startswith("timing/") else f"timing/{name}"
        self._spans.setdefault(key, []).append((float(start), float(end)))

    def spans(self) -> dict[str, list[Span]]:
        return {k: list(v) for k, v in self._spans.items()}

    def merge(self, other: "Timers") -> None:
        """Add ``other``'s spans (phases that ran elsewhere, e.g. in the rollout thread)."""
        for key, spans in other.spans().items():
            self._spans.setdefault(key, []).extend(spans)

    def reset(self) -> None:
        self._spans.clear()

    def metrics(self) -> dict[str, float]:
        out = {key: span_seconds(key, spans) for key, spans in self._spans.items()}
        out.update(non_overlap_timings(self._spans))
        return out


def _bounds(spans: dict[str, list[Span]], name: str) -> Span | None:
    got = spans.get(f"timing/{name}")
    if not got:
        return None
    return min(s for s, _ in got), max(e for _, e in got)


def non_overlap_timings(spans: dict[str, list[Span]]) -> dict[str, float]:
    """The seed's ``timing/non_overlap_*`` keys from phase spans (formulas in the module docstring)."""
    old = _bounds(spans, "old_log_p")
    ref = _bounds(spans, "reference_model")
    old_end = old[1] if old else (ref[1] if ref else None)
    out: dict[str, float] = {}
    if old_end is not None:
        for phase in ("reference_model", "rule_reward", "reward_model"):
            b = _bounds(spans, phase)
            if b is not None:
                out[f"timing/non_overlap_{phase}"] = max(b[1] - max(old_end, b[0]), 0.0)
    adv = _bounds(spans, "adv")
    if adv is not None:
        out["timing/non_overlap_adv"] = (max(adv[1] - old_end, 0.0) if old_end is not None
                                         else span_seconds("timing/adv", spans["timing/adv"]))
    return out
