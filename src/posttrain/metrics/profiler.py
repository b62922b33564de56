"""The seed's profiler (``profiler_config.integrated``) on ``torch.profiler``.

Iterations ``profile_step_start`` to ``profile_step_end`` (exclusive) are profiled:

* ``stage: all``: each whole iteration, one trace each (the seed's schedule: skip the iterations
  before the start, then ``end - start`` active ones);
* a stage or a list of stages: only those phases of those iterations, one trace per phase run
  (the seed's stage names map to the loop's phases: :data:`STAGES`).

Each trace is a Chrome/Perfetto JSON file (``profile_export_type: text``; ``db`` is Ascend's
database format and is refused by the config check) in ``<profile_save_path>/<role>/rank_<r>/``:
``trace_iter_<i>.json`` or ``trace_iter_<i>_<stage>.json``. ``profile_analysis: true`` adds
``profile_iter_<i>[_<stage>].txt``: the per-op tables of ``posttrain bench --profile`` (ops by self
time, then ops and phases by total time). The loop's phases are ``record_function`` ranges named
``timing/<phase>`` in every trace; with ``mstx: true`` on CUDA they are NVTX ranges too
(:meth:`RunProfiler.range`), for Nsight Systems.

Levels add detail on top of the switches (``profile_record_shapes``, ``profile_with_memory``,
``profile_with_module``, which each turn theirs on at any level): ``level_none`` and ``level0``
record the ops alone, ``level1`` adds their input shapes, ``level2`` adds shapes, memory and Python
stacks. ``profile_with_cpu`` and ``profile_with_npu`` select the CPU and the device (CUDA)
activities. ``profile_ranks`` (``all`` or a list) names the ranks that profile.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# the seed's stage names -> the loop's phases (metrics.timers names)
STAGES = {"actor_generate": "rollout", "actor_compute_log_prob": "old_log_p",
          "reference_compute_log_prob": "reference_model", "critic_compute_values": "critic_model",
          "actor_update": "update", "critic_update": "update_critic"}
LEVELS = ("level_none", "level0", "level1", "level2")


@dataclass(frozen=True)
class ProfilerOptions:
    """``profiler_config.integrated``, checked (:func:`posttrain.config.options.profiler_options`)."""

    save_path: str
    start: int  # first profiled iteration
    end: int  # exclusive
    stages: tuple[str, ...] | None = None  # the seed's stage names; None: whole iterations
    level: str = "level0"
    cpu: bool = True
    device: bool = True
    record_shapes: bool = False
    memory: bool = False
    stack: bool = False
    analysis: bool = False
    ranks: tuple[int, ...] | None = None  # None: all
    mstx: bool = False
    role: str = "integrated"


class RunProfiler:
    """The profiler of one process (``rank`` of its role); a no-op outside its window and ranks."""

    def __init__(self, options: ProfilerOptions | None, device: str = "cpu", rank: int = 0) -> None:
        self.options, self.device, self.rank = options, device, rank
        self.iteration: int | None = None
        self.written: list[Path] = []

    @property
    def active(self) -> bool:
        o = self.options
        return (o is not None and self.iteration is not None and o.start <= self.iteration < o.end
                and (o.ranks is None or self.rank in o.ranks))

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Around one iteration: profiles it whole when the stage is ``all``."""
        self.iteration = iteration
        try:
            if self.active and self.options.stages is None:
                with self._profiled(f"iter_{iteration}"):
                    yield
            else:
                yield
        finally:
            self.iteration = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Around one phase of the loop (``rollout``, ``update``...): profiled when its stage is named."""
        o = self.options
        stage = next((s for s in (o.stages or ()) if STAGES[s] == name), None) if o is not None else None
        with self.range(name):
            if stage is not None and self.active:
                with self._profiled(f"iter_{self.iteration}_{stage}"):
                    yield
            else:
                yield

    def range(self, name: str):
        """An NVTX range around a phase with ``mstx: true`` on CUDA (the ``record_function`` range
        of :class:`~posttrain.metrics.timers.Timers` is there anyway)."""
        if self.options is None or not self.options.mstx or not self.device.startswith("cuda"):
            return contextlib.nullcontext()
        import torch

        return torch.cuda.nvtx.range(f"timing/{name}")

    @contextlib.contextmanager
    def _profiled(self, label: str) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile

        o = self.options
        activities = ([ProfilerActivity.CPU] if o.cpu else []) + (
            [ProfilerActivity.CUDA] if o.device and self.device.startswith("cuda") else [])
        detail = LEVELS.index(o.level)
        with profile(activities=activities or [ProfilerActivity.CPU], record_shapes=o.record_shapes or detail >= 2,
                     profile_memory=o.memory or detail >= 3, with_stack=o.stack or detail >= 3) as prof:
            yield
        self.written += export(prof, Path(o.save_path) / o.role / f"rank_{self.rank}", label, o.analysis)


def export(prof, folder: Path, label: str, analysis: bool) -> list[Path]:
    """``trace_<label>.json`` (Chrome/Perfetto) and, with ``analysis``, ``profile_<label>.txt`` (the
    per-op tables) in ``folder``, each written to a temporary name and renamed."""
    from posttrain.metrics.sinks import write_text_atomic

    folder.mkdir(parents=True, exist_ok=True)
    trace, tmp = folder / f"trace_{label}.json", folder / f".trace_{label}.json.tmp-{os.getpid()}"
    try:
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, trace)
    finally:
        tmp.unlink(missing_ok=True)
    written = [trace]
    if analysis:
        written.append(folder / f"profile_{label}.txt")
        write_text_atomic(written[-1], op_tables(prof))
    return written


def op_tables(prof) -> str:
    """Ops by self time, then ops and phases (``timing/*`` ranges) by total time."""
    averages = prof.key_averages()
    return ("ops by self time\n" + averages.table(sort_by="self_cpu_time_total", row_limit=25)
            + "\n\nops and phases by total time\n" + averages.table(sort_by="cpu_time_total", row_limit=25))
