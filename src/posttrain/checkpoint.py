"""Save and resume training state in Megatron's directory layout, with an HF-loadable actor.

Layout (docs/checkpoints.md)::

    <save>/latest_checkpointed_iteration.txt     "5"
    <save>/iter_0000005/config.json, model.safetensors, tokenizer files   (HF actor)
                        optimizer.pt  scheduler.pt  rng.pt  sampler.pt  trainer_state.json
                        <name>/...                                         (extra parts: critic)

Saving is atomic: everything is written into a hidden temporary directory next to the target,
fsynced and renamed; then the tracker file is replaced atomically. A failed save raises
:class:`CheckpointError` and leaves the previous checkpoint and tracker untouched.

Resume semantics follow the seed (section 8.2): ``finetune`` loads weights only and restarts at
iteration 0; ``no_load_optim`` skips optimizer and scheduler; ``no_load_rng`` skips RNG states.
When to save (``save_interval``) is the training loop's decision, not this module's.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import pickle
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
FORMAT = "posttrain-checkpoint/1"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


@dataclass
class Part:
    """An extra trained module saved in its own subdirectory (e.g. the PPO critic)."""

    model: Any
    optimizer: Any = None
    scheduler: Any = None


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


# ---------------------------------------------------------------------------- low-level writers
def _torch_save(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (so the rename publishes durable data)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- RNG
def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Python, numpy, torch (CPU, CUDA if initialised) and ``generator`` states, as tensors/lists."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


# ---------------------------------------------------------------------------- save
def _save_part(out: Path, model: Any, optimizer: Any, scheduler: Any, tokenizer: Any,
               save_optim: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if save_optim and optimizer is not None:
        _torch_save(optimizer.state_dict(), out / "optimizer.pt")
    if save_optim and scheduler is not None:
        _torch_save(scheduler.state_dict(), out / "scheduler.pt")


def _write_checkpoint(tmp: Path, iteration: int, model: Any, optimizer: Any, scheduler: Any,
                      tokenizer: Any, generator: Any, sampler_state: Any, trainer_state: dict,
                      extra: dict[str, Part], save_optim: bool, save_rng: bool) -> None:
    _save_part(tmp, model, optimizer, scheduler, tokenizer, save_optim)
    for name, part in extra.items():
        _save_part(tmp / name, part.model, part.optimizer, part.scheduler, None, save_optim)
    if save_rng:
        _torch_save(rng_state(generator), tmp / "rng.pt")
    if sampler_state is not None:
        _torch_save(sampler_state, tmp / "sampler.pt")
    state = {"format": FORMAT, **trainer_state, "iteration": iteration}
    _write_text(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True) + "\n")


def _write_tracker(save_dir: Path, iteration: int) -> None:
    tmp = save_dir / f".{TRACKER}.tmp-{os.getpid()}"
    _write_text(tmp, f"{iteration}\n")
    os.replace(tmp, save_dir / TRACKER)
    _fsync_dir(save_dir)


def _publish(tmp: Path, target: Path, aside: Path, save_dir: Path, iteration: int) -> None:
    """Rename ``tmp`` to ``target`` and update the tracker; on failure restore the old state.

    Re-saving an existing iteration moves the old directory aside first and deletes it only
    once the tracker is written.
    """
    had_old = target.exists()
    if had_old:
        os.rename(target, aside)
    try:
        os.rename(tmp, target)
        _fsync_dir(save_dir)
        _write_tracker(save_dir, iteration)
    except BaseException:
        if target.exists() and not tmp.exists():
            shutil.rmtree(target, ignore_errors=True)
        if had_old:
            os.rename(aside, target)
        raise
    if had_old:
        shutil.rmtree(aside, ignore_errors=True)


def _remove_stale_temps(save_dir: Path) -> None:
    """Remove temporary dirs left by a save that was killed (single writer per save dir)."""
    for path in save_dir.glob(".iter_*.tmp*"):
        shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(save_dir: str | Path, iteration: int, model: Any, optimizer: Any = None,
                    scheduler: Any = None, *, tokenizer: Any = None,
                    generator: torch.Generator | None = None, sampler_state: Any = None,
                    trainer_state: dict | None = None, extra: dict[str, Part] | None = None,
                    save_optim: bool = True, save_rng: bool = True,
                    keep_last: int | None = None) -> Path:
    """Write ``<save_dir>/iter_XXXXXXX`` atomically and point the tracker file at it.

    Args:
        model: an HF ``PreTrainedModel`` (saved with ``save_pretrained``, safetensors).
        tokenizer: saved next to the weights so the directory loads with ``from_pretrained``.
        generator: a ``torch.Generator`` whose state is saved with the global RNG states.
        sampler_state: the data sampler's state (tensors, numbers, lists, dicts).
        trainer_state: JSON-serialisable loop state (consumed samples, KL coefficient...).
        extra: more modules to save in subdirectories, e.g. ``{"critic": Part(critic, opt)}``.
        save_optim / save_rng: the seed's ``no_save_optim`` / ``no_save_rng`` negated.
        keep_last: if set, delete older ``iter_*`` directories beyond the newest ``keep_last``.
    Returns the checkpoint directory. Call it on one process (rank 0) with full weights.
    """
    save_dir = Path(save_dir)
    target = save_dir / iter_dir_name(iteration)
    trainer_state = dict(trainer_state or {})
    try:
        json.dumps(trainer_state)
    except TypeError as err:
        raise CheckpointError(f"trainer_state must be JSON-serialisable: {err}") from err
    tmp = save_dir / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(save_dir)
        tmp.mkdir()
    except OSError as err:
        raise CheckpointError(f"cannot create the checkpoint directory {save_dir}: {err}") from err
    previous = _previous(save_dir)
    aside = save_dir / f".{target.name}.tmp-old-{os.getpid()}"
    try:
        _write_checkpoint(tmp, iteration, model, optimizer, scheduler, tokenizer, generator,
                          sampler_state, trainer_state, extra or {}, save_optim, save_rng)
        _fsync_tree(tmp)
        _publish(tmp, target, aside, save_dir, iteration)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, (OSError, RuntimeError, ValueError, pickle.PicklingError)):
            raise
        kept = f"the previous checkpoint {previous} is intact" if previous else "nothing was saved"
        raise CheckpointError(f"saving checkpoint iteration {iteration} to {target} failed: "
                              f"{err}; {kept}. Free disk space or change `save`.") from err
    if keep_last:
        prune_checkpoints(save_dir, keep_last)
    return target


def _previous(save_dir: Path) -> Path | None:
    try:
        return find_latest(save_dir)
    except CheckpointError:
        return None


def list_checkpoints(save_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete ``iter_*`` directories (with trainer_state.json), oldest first."""
    found = []
    for path in Path(save_dir).glob("iter_*"):
        m = _ITER_RE.match(path.name)
        if m and (path / STATE_FILE).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def prune_checkpoints(save_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (never the tracker's); returns the deleted."""
    latest = find_latest(save_dir)
    doomed = [p for _, p in list_checkpoints(save_dir)[:-keep_last] if p != latest]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


# ---------------------------------------------------------------------------- load
def find_latest(load_dir: str | Path) -> Path | None:
    """The checkpoint the tracker names; without a tracker, the newest complete ``iter_*``; or None."""
    load_dir = Path(load_dir)
    tracker = load_dir / TRACKER
    if tracker.is_file():
        text = tracker.read_text(encoding="utf-8").strip()
        if not text.isdigit():
            raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
        path = load_dir / iter_dir_name(int(text))
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(f"{tracker} names iteration {text} but {path} is missing or "
                                  f"incomplete; fix the tracker file or load an earlier iter_* dir")
        return path
    found = list_checkpoints(load_dir)
    return found[-1][1] if found else None


def _is_hf_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and bool(_weight_files(path))


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF dir: from the shard index, else model.safetensors, else all."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    found = sorted(path.glob("*.safetensors"))
    if found or not (path / "pytorch_model.bin").is_file():
        return found
    return [path / "pytorch_model.bin"]


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [f for f in _weight_files(path) if f.suffix == ".safetensors"]
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise CheckpointError(f"{path}: no *.safetensors or pytorch_model.bin weights found")


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Copy the HF weights saved in ``path`` into ``model`` in place (tied weights allowed)."""
    path = Path(path)
    state = _read_weights(path)
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded_ptrs]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}); is this checkpoint for this model?")
    mismatched = [k for k in state if state[k].shape != own[k].shape]
    if mismatched:
        k = mismatched[0]
        raise CheckpointError(f"{path}: {k} has shape {tuple(state[k].shape)} in the checkpoint "
                              f"but {tuple(own[k].shape)} in the model")
    model.load_state_dict(state, strict=False)


def _load_file(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as err:
        raise CheckpointError(f"{path}: cannot be read ({err})") from err


def _load_optim(path: Path, optimizer: Any, scheduler: Any) -> None:
    for obj, name in ((optimizer, "optimizer.pt"), (scheduler, "scheduler.pt")):
        if obj is None:
            continue
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name} is missing (saved with no_save_optim?); set "
                                  f"no_load_optim: true to start with a fresh optimizer")
        try:
            obj.load_state_dict(_load_file(path / name))
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{path / name} does not fit this {type(obj).__name__} ({err}); "
                                  f"set no_load_optim: true to start with a fresh one") from err


def load_part(checkpoint_dir: str | Path, name: str, part: Part, *, no_load_optim: bool = False) -> bool:
    """Restore an extra part saved by ``save_checkpoint(extra={name: part})`` (weights, and unless
    ``no_load_optim`` its optimizer and scheduler); False when the checkpoint has no such part."""
    path = Path(checkpoint_dir) / name
    if not (path / "config.json").is_file():
        return False
    load_weights(path, part.model)
    if not no_load_optim:
        _load_optim(path, part.optimizer, part.scheduler)
    return True


def resolve_checkpoint(load_dir: str | Path) -> tuple[Path, bool]:
    """``(directory, is_full_checkpoint)`` for a save dir, an ``iter_*`` dir or a plain HF dir."""
    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        raise CheckpointError(f"load: {load_dir} is not a directory")
    if (load_dir / STATE_FILE).is_file():
        return load_dir, True
    latest = find_latest(load_dir)
    if latest is not None:
        return latest, True
    if _is_hf_model_dir(load_dir):
        return load_dir, False
    raise CheckpointError(f"load: no checkpoint in {load_dir}: expected {TRACKER}, iter_XXXXXXX/ "
                          f"directories or an HF model directory (config.json + *.safetensors)")


def load_checkpoint(load_dir: str | Path, model: Any, optimizer: Any = None, scheduler: Any = None,
                    *, finetune: bool = False, no_load_optim: bool = False,
                    no_load_rng: bool = False, generator: torch.Generator | None = None,
                    extra: dict[str, Part] | None = None) -> dict[str, Any]:
    """Load weights (always) and, for a resume, optimizer/scheduler/RNG/sampler/trainer state.

    Returns the trainer state: the saved dict (``iteration``, ``consumed_samples``, ...) plus
    ``sampler_state`` (None if not restored) and ``checkpoint_dir``. With ``finetune`` or a plain
    HF directory: weights only, ``{"iteration": 0, "consumed_samples": 0, ...}``.
    """
    path, full = resolve_checkpoint(load_dir)
    load_weights(path, model)
    if not (finetune or not full or no_load_optim):
        _load_optim(path, optimizer, scheduler)
    for name, part in (extra or {}).items():
        if not load_part(path, name, part, no_load_optim=finetune or not full or no_load_optim):
            raise CheckpointError(f"{path / name} is missing: this checkpoint has no {name}")
    if finetune or not full:
        return {"iteration": 0, "consumed_samples": 0, "sampler_state": None,
                "checkpoint_dir": str(path)}
    if not no_load_rng:
        if not (path / "rng.pt").is_file():
            raise CheckpointError(f"{path / 'rng.pt'} is missing (saved with no_save_rng?); set "
                                  f"no_load_rng: true to resume without it")
        set_rng_state(_load_file(path / "rng.pt"), generator)
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    state.pop("format", None)
    sampler = path / "sampler.pt"
    state["sampler_state"] = _load_file(sampler) if sampler.is_file() else None
    state["checkpoint_dir"] = str(path)
    return state
