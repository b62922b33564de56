"""Where metrics go: console, JSONL (always), TensorBoard and wandb (optional); trackio and MLflow
(optional, :mod:`posttrain.metrics.trackers`).

:class:`MetricsLogger` fans one ``{key: float}`` dict per iteration out to every enabled sink.
Optional backends are imported only when enabled; a missing wandb is skipped with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.errors import PosttrainError
from posttrain.files import write_text_atomic as write_file_atomic
from posttrain.metrics.reduce import sort_metrics, to_float

log = logging.getLogger(__name__)

CONSOLE_KEYS = ("timing/all", "grpo/score/mean", "dapo/score/mean", "critic/score/mean",
                "*_rewards/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy",
                "actor/grad_norm", "response_length/mean", "e2e_tps")


def format_value(key: str, value: float) -> str:
    """4 decimals; keys containing ``lr`` in scientific notation (seed console format)."""
    return f"{value:.4e}" if "lr" in key else f"{value:.4f}"


def _select(metrics: Mapping[str, float], patterns: Sequence[str]) -> dict[str, float]:
    out = {}
    for pat in patterns:
        if pat.startswith("*"):
            out.update({k: v for k, v in metrics.items() if k.endswith(pat[1:])})
        elif pat in metrics:
            out[pat] = metrics[pat]
    return out


def format_line(iteration: int, total: int | None, metrics: Mapping[str, float]) -> str:
    """``[UTC time] iteration: i / N | key : value | ...`` (seed ``utils/loggers.py`` layout)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    head = f"[{stamp}] iteration: {iteration} / {total if total is not None else '?'}"
    return " | ".join([head] + [f"{k} : {format_value(k, v)}" for k, v in metrics.items()])


class ConsoleSink:
    """A rich progress bar over iterations (on a terminal) and one line per iteration.

    ``keys`` picks the compact line's keys (``*suffix`` matches by suffix); ``keys=None`` prints
    every key like the seed.
    """

    def __init__(self, total_iters: int | None, keys: Sequence[str] | None = CONSOLE_KEYS,
                 start_iteration: int = 0, console: Any = None) -> None:
        from rich.console import Console  # lazy: rich only for the console sink

        self.total, self.keys = total_iters, keys
        self.console = console or Console(stderr=False)
        self.progress = None
        if self.console.is_terminal and total_iters:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), TimeRemainingColumn(),
                                     console=self.console, transient=False)
            self.task = self.progress.add_task("train", total=total_iters, completed=start_iteration)
            self.progress.start()

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        shown = metrics if self.keys is None else _select(metrics, self.keys)
        if self.progress is not None:
            self.progress.update(self.task, completed=iteration)
        self.console.print(format_line(iteration, self.total, shown), markup=False,
                           highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None


class LogWriteError(PosttrainError):
    """A run's log file (metrics.jsonl, eval.jsonl, config.json, run.json) cannot be written."""


def _write_failed(path: Path, what: str, err: OSError, kept: str = "the file keeps every complete line it had"
                  ) -> LogWriteError:
    why = "the disk is full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else (err.strerror or str(err))
    return LogWriteError(f"{path}: cannot write {what} ({why}); {kept}. Free space (or fix the directory) and "
                         f"resume from the last checkpoint, if any: its later iterations are logged again")


def write_text_atomic(path: str | Path, text: str) -> None:
    """:func:`posttrain.files.write_text_atomic`, failing with :class:`LogWriteError` (the file is as it was)."""
    write_file_atomic(path, text, lambda p, err: _write_failed(p, "it", err, "the file is as it was"))


def cut_jsonl(path: str | Path, after_iteration: int | None) -> None:
    """Rewrite the JSONL log ``path`` (atomically, see :func:`write_text_atomic`) without the rows
    whose ``iteration`` is above ``after_iteration`` (None: keep them all) and without malformed
    lines (a killed run's half-written last line). A resumed run calls it with the iteration it
    resumes from, so the iterations that ran after the last save are not logged twice."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    kept = []
    if path.exists():
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(row, dict):
                    continue
                it = row.get("iteration")
                if after_iteration is not None and isinstance(it, (int, float)) and it > after_iteration:
                    continue
                kept.append(line if line.endswith("\n") else line + "\n")
    write_text_atomic(path, "".join(kept))


def open_append(path: str | Path):
    """``path`` opened for appending text, refusing to follow a symlink there (OSError)."""
    return os.fdopen(_append_fd(path), "a", encoding="utf-8")


def _append_fd(path: str | Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)


def write_line(fd: int, path: Path, line: str, what: str) -> None:
    """Append the whole ``line`` to the file open at ``fd`` (``path``), or nothing: a failed write
    (a full disk) is cut back to where the line began, and raises :class:`LogWriteError`."""
    data = memoryview(line.encode("utf-8"))
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as err:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise _write_failed(path, what, err) from None


def append_line(path: str | Path, line: str, what: str) -> None:
    """:func:`write_line` into ``path`` (opened, and closed again)."""
    try:
        fd = _append_fd(path)
    except OSError as err:
        raise _write_failed(Path(path), what, err) from None
    try:
        write_line(fd, Path(path), line, what)
    finally:
        os.close(fd)


class JsonlSink:
    """One JSON object per iteration appended to ``path`` and flushed at once.

    Line: ``{"iteration": i, "time": unix seconds, "<key>": value, ...}``; NaN/inf become null.
    Appending lets a resumed run continue the same file; ``after_iteration`` (the iteration a
    run resumes from) first drops the rows logged after it (:func:`cut_jsonl`). An existing file
    is first replaced by a copy (never written through a symlink).
    """

    def __init__(self, path: str | Path, after_iteration: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut_jsonl(self.path, after_iteration)
        try:
            self._fd: int | None = _append_fd(self.path)
        except OSError as err:
            raise _write_failed(self.path, "the metrics", err) from None

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """One whole line, or none (a full disk): see :func:`write_line`."""
        record = {"iteration": iteration, "time": round(time.time(), 3)}
        record.update({k: _json_number(v) for k, v in metrics.items()})
        if self._fd is not None:
            write_line(self._fd, self.path, json.dumps(record, allow_nan=False) + "\n",
                       f"the metrics of iteration {iteration}")

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class TensorBoardSink:
    """``add_scalar("train/<key>", value, iteration)`` (seed layout) into ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard and torch only for this sink

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"train/{key}", value, iteration)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def network_reachable(host: str = "api.wandb.ai", port: int = 443, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wandb_mode(environ: Mapping[str, str] | None = None, reachable: Any = None) -> str:
    """``WANDB_MODE`` if set, else ``online`` when the wandb server answers, else ``offline``."""
    environ = os.environ if environ is None else environ
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    return "online" if (reachable or network_reachable)() else "offline"


class WandbSink:
    """wandb run (``log(metrics, step=iteration)``); offline when there is no network.

    If ``wandb.init`` fails, it retries once offline (the seed's fallback). ``available`` is
    False when wandb is not installed (a warning is issued and nothing is logged).
    """

    def __init__(self, project: str, exp_name: str, save_dir: str | Path,
                 config: Mapping[str, Any] | None = None) -> None:
        self.run = None
        try:
            import wandb
        except ImportError:
            warnings.warn("use_wandb is true but wandb is not installed; wandb logging is skipped "
                          "(pip install wandb, or pip install posttrain[wandb])", stacklevel=2)
            return
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        kwargs = dict(project=project, name=exp_name, dir=str(save_dir),
                      config=dict(config or {}))
        try:
            self.run = wandb.init(mode=wandb_mode(), **kwargs)
        except Exception as err:  # noqa: BLE001  (any init failure -> offline, like the seed)
            log.warning("wandb.init failed (%s); retrying in offline mode", err)
            self.run = wandb.init(mode="offline", **kwargs)

    @property
    def available(self) -> bool:
        return self.run is not None

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=iteration)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MetricsLogger:
    """All sinks of one run. ``log(iteration, metrics)`` once per iteration; ``close()`` at the end.

    Always: console and ``<run_dir>/metrics.jsonl``. ``use_tensorboard``: TensorBoard in
    ``tensorboard_dir`` (default ``<run_dir>/tensorboard``). ``use_wandb``: wandb project
    ``wandb_project`` (default ``posttrain``), run ``wandb_exp_name`` (default the run dir's
    name), files in ``wandb_save_dir`` (default ``<run_dir>/wandb``). Unlike the seed, enabling
    wandb does not disable TensorBoard. ``trackio_project`` / ``mlflow_uri`` (not None): those
    trackers, ``swanlab`` (mode, project, experiment, directory) SwanLab
    (:mod:`posttrain.metrics.trackers`). ``resume_iteration``: the JSONL log keeps only the rows up
    to that iteration (a resumed run logs the later ones again).
    """

    def __init__(self, run_dir: str | Path, use_tensorboard: bool = False,
                 tensorboard_dir: str | Path | None = None, use_wandb: bool = False,
                 wandb_project: str = "", wandb_exp_name: str = "", wandb_save_dir: str = "",
                 total_iters: int | None = None, *, console: bool = True,
                 console_keys: Sequence[str] | None = CONSOLE_KEYS, start_iteration: int = 0,
                 jsonl_name: str = "metrics.jsonl", config: Mapping[str, Any] | None = None,
                 resume_iteration: int | None = None, trackio_project: str | None = None,
                 mlflow_uri: str | None = None, mlflow_experiment: str = "posttrain",
                 swanlab: tuple[str, str, str, str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.jsonl_path = self.run_dir / jsonl_name
        self.sinks: list[Any] = [JsonlSink(self.jsonl_path, after_iteration=resume_iteration)]
        if console:
            self.sinks.append(ConsoleSink(total_iters, console_keys, start_iteration))
        if use_tensorboard:
            self.sinks.append(TensorBoardSink(tensorboard_dir or self.run_dir / "tensorboard"))
        if use_wandb:
            sink = WandbSink(wandb_project or "posttrain", wandb_exp_name or self.run_dir.name,
                             wandb_save_dir or self.run_dir / "wandb", config)
            if sink.available:
                self.sinks.append(sink)
        if trackio_project is not None or mlflow_uri is not None or swanlab:  # posttrain.metrics.trackers
            from posttrain.metrics.trackers import MLflowSink, SwanlabSink, TrackioSink

            if trackio_project is not None:
                self.sinks.append(TrackioSink(trackio_project, self.run_dir.name, config))
            if mlflow_uri is not None:
                uri = mlflow_uri or f"file:{(self.run_dir / 'mlruns').resolve()}"
                self.sinks.append(MLflowSink(uri, mlflow_experiment, self.run_dir.name, config))
            if swanlab:
                mode, project, name, save_dir = swanlab
                self.sinks.append(SwanlabSink(mode, project, name or self.run_dir.name,
                                              save_dir or self.run_dir / "swanlab", config))

    def log(self, iteration: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Convert values to floats, sort them in the seed's order and write to every sink."""
        clean = sort_metrics({k: to_float(v) for k, v in metrics.items()})
        for sink in self.sinks:
            sink.log(iteration, clean)
        return clean

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
