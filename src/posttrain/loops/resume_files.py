"""What an on-policy checkpoint saves of its experience source beyond the weights, as plain data:
the in-flight experiences of an asynchronous run (``in_flight.pt``) and the partial-rollout dock
(``partial_rollout.pt``).

Both are written as tensors, lists, tuples, dicts, numbers and strings only, and read back with
``torch.load(weights_only=True)``: a file that holds any other pickled object is refused (it
could run code when unpickled), naming the file. At a resume the run checks that the checkpoint
holds the files its settings say it saved, and that it is resumed with those settings: resuming an
asynchronous checkpoint synchronously, or a partial-rollout one without partial rollout, would
drop its pending samples, so it is refused (docs/async.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.checkpoint.verify import _load_file
from posttrain.errors import CheckpointError, ConfigError
from posttrain.metrics.reduce import MetricAccumulator
from posttrain.transfer_dock import TransferDock, TransferDockError

IN_FLIGHT = "in_flight.pt"  # async: the finished experiences not trained on yet
PARTIAL = "partial_rollout.pt"  # partial rollout: the dock of unfinished and waiting samples


def plain_dock(state: dict[str, Any]) -> dict[str, Any]:
    """A TransferDock's ``state_dict()`` as plain data (its numpy masks as lists of bools)."""
    return {"data": {c: list(v) for c, v in state["data"].items()},
            "ready": {c: [bool(x) for x in v] for c, v in state["ready"].items()},
            "consumed": {c: [bool(x) for x in v] for c, v in state["consumed"].items()},
            "rng": state["rng"]}


def plain_experience(exp) -> dict[str, Any]:
    """An :class:`~posttrain.loops.produce.Experience` as plain data."""
    return {"dock": plain_dock(exp.td.state_dict()), "timers": exp.timers.spans(), "acc": exp.acc.raw(),
            "metrics": {str(k): float(v) for k, v in exp.metrics.items()}, "num_gen_batches": int(exp.num_gen_batches)}


class _Raw:
    """Saved accumulator values, in the shape :meth:`MetricAccumulator.merge` reads."""

    def __init__(self, values: dict[str, list]):
        self.values = values

    def raw(self) -> dict[str, list]:
        return self.values


def load_dock(dock: TransferDock, state: Any, path: Path) -> None:
    """Restore ``dock`` from its saved plain state; CheckpointError naming ``path`` if it does not fit."""
    try:
        dock.load_state_dict(state)
    except (TransferDockError, KeyError, TypeError, ValueError, IndexError, StopIteration) as err:
        raise CheckpointError(f"{path}: its saved samples do not fit this run ({type(err).__name__}: {err}); the "
                              f"file is corrupt, or the run's global_batch_size / n_samples_per_prompt differ from "
                              f"the checkpoint's: resume with the same values") from None


def restore_experience(saved: Any, exp, path: Path):
    """Fill the empty Experience ``exp`` from :func:`plain_experience`'s data; returns it."""
    if not isinstance(saved, dict) or not {"dock", "timers", "acc", "metrics"} <= set(saved):
        raise CheckpointError(f"{path}: not the in-flight experiences posttrain saves (found "
                              f"{type(saved).__name__}); the file is corrupt")
    load_dock(exp.td, saved["dock"], path)
    try:
        for key, spans in saved["timers"].items():
            for start, end in spans:
                exp.timers.record(key, start, end)
        acc = MetricAccumulator()
        acc.merge(_Raw({str(k): list(v) for k, v in saved["acc"].items()}))
        exp.acc = acc
        exp.metrics = {str(k): float(v) for k, v in saved["metrics"].items()}
        exp.num_gen_batches = int(saved.get("num_gen_batches", 1))
    except (AttributeError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: not the in-flight experiences posttrain saves ({err}); the file is "
                              f"corrupt") from None
    return exp


def load_in_flight(path: Path, new_experience) -> dict[int, Any]:
    """The in-flight experiences saved in ``path`` (iteration -> Experience); ``new_experience(it)``
    makes iteration ``it``'s empty one."""
    saved = _load_file(path)
    if not isinstance(saved, dict) or not all(isinstance(k, int) for k in saved):
        raise CheckpointError(f"{path}: expected a dict of iteration -> experience, found {type(saved).__name__}; "
                              f"the file is corrupt")
    return {it: restore_experience(exp, new_experience(it), path) for it, exp in saved.items()}


def load_partial(path: Path, dock: TransferDock) -> None:
    """The partial-rollout dock saved in ``path`` into ``dock``."""
    load_dock(dock, _load_file(path), path)


def check_resumed_source(state: dict, *, staleness: int | None, pipelined: bool, partial_max_split: int | None) -> None:
    """Refuse a resume that would drop the source's saved samples: the checkpoint's asynchronous or
    partial-rollout setting differs from this run's, or the file it saved is missing."""
    path = state.get("checkpoint_dir")
    if not (state.get("iteration") and path):
        return
    path = Path(path)
    saved_staleness = state.get("async_staleness")
    saved_pipelined = state.get("in_flight_saved", (path / IN_FLIGHT).is_file() or bool(saved_staleness))
    if saved_pipelined and (not pipelined or saved_staleness != staleness):
        raise ConfigError(f"{path} was saved by an asynchronous run (rl_config.async_staleness={saved_staleness}) "
                          f"with its in-flight samples in {IN_FLIGHT}; resume it with "
                          f"rl_config.async_staleness={saved_staleness} (they were drawn for it; a different value "
                          f"would drop them), or start a new run from it with actor_config.finetune=true")
    if saved_pipelined and not (path / IN_FLIGHT).is_file():
        raise CheckpointError(f"{path / IN_FLIGHT} is missing: this asynchronous checkpoint saved its in-flight "
                              f"samples there, and resuming without them would not repeat the run. Restore the "
                              f"file, resume from an earlier checkpoint, or start anew with actor_config.finetune=true")
    saved_split = state.get("partial_rollout_max_split", None)
    saved_partial = saved_split is not None or (path / PARTIAL).is_file()
    if saved_partial and saved_split is not None and saved_split != partial_max_split:
        raise ConfigError(f"{path} was saved by a run with rl_config.partial_rollout_max_split={saved_split}, and its "
                          f"unfinished samples are in {PARTIAL}; resume it with the same value (a different one "
                          f"would drop or mistime them), or start a new run with actor_config.finetune=true")
    if saved_partial and partial_max_split is None:
        raise ConfigError(f"{path} holds the unfinished samples of a partial rollout ({PARTIAL}); resume it with "
                          f"rl_config.partial_rollout_max_split set as when it was saved, or start a new run "
                          f"with actor_config.finetune=true")
    if saved_split is not None and not (path / PARTIAL).is_file():
        raise CheckpointError(f"{path / PARTIAL} is missing: this partial-rollout checkpoint saved its unfinished "
                              f"samples there. Restore the file, resume from an earlier checkpoint, or start anew "
                              f"with actor_config.finetune=true")
