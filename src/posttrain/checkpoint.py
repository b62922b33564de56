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
import logging
import os
import random
import re
import shutil
import pickle
import secrets
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.errors import CheckpointError

log = logging.getLogger(__name__)

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


def current_umask() -> int:
    """The process umask, read without changing it (Linux ``/proc``), else by a set-and-restore."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_readable(root: str | Path) -> None:
    """Give every file under ``root`` the mode a plain ``open()`` would (0644 under umask 022) and
    every directory 0755: ``save_pretrained`` writes weights 0600 and ``mkdtemp`` makes dirs 0700,
    which other users and serving containers cannot read. Symlinks are left alone."""
    mask = current_umask()
    root = Path(root)
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            if not os.path.islink(os.path.join(dirpath, name)):
                os.chmod(os.path.join(dirpath, name), 0o777 & ~mask)
        for name in files:
            if not os.path.islink(os.path.join(dirpath, name)):
                os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


def _remove_path(path: Path) -> None:
    """Remove a file, a symlink (never what it points at) or a directory tree; errors are ignored."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


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
               save_optim: bool, adapter_only: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)  # a PEFT model: its adapter
    if hasattr(model, "peft_config") and not adapter_only:  # and the (frozen) base in base/ (models.lora)
        save_hf_weights(model, out / "base")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if save_optim and optimizer is not None:
        _torch_save(optimizer.state_dict(), out / "optimizer.pt")
    if save_optim and scheduler is not None:
        _torch_save(scheduler.state_dict(), out / "scheduler.pt")


def save_hf_weights(model, out: Path) -> None:
    """The base model of the PEFT ``model`` (or a plain model) as an HF directory in ``out``
    (``config.json`` and ``model.safetensors``; a tied weight once). Written from the state dict,
    without the adapter's tensors and with PEFT's ``base_layer`` names mapped back to the base
    model's own: inside a PEFT model the base's linears are wrapped in LoRA layers."""
    from safetensors.torch import save_file

    base = model.get_base_model() if hasattr(model, "peft_config") else model
    Path(out).mkdir(parents=True, exist_ok=True)
    base.config.save_pretrained(str(out))
    tensors, seen = {}, set()
    for name, tensor in base.state_dict().items():
        if "lora_" in name or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name.replace(".base_layer.", ".")] = tensor.detach().contiguous()
    save_file(tensors, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})


def load_adapter_weights(path: str | Path, model) -> None:
    """The adapter weights saved in ``path`` (``adapter_model.safetensors``) into the PEFT ``model``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} holds no LoRA adapter, but this run trains one "
                              f"(actor_config.lora_target_modules); load a LoRA checkpoint or start from the base")
    result = set_peft_model_state_dict(model, load_file(str(file)))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k]
    if unexpected or missing:
        raise CheckpointError(f"{file}: its adapter does not fit this model (unexpected {unexpected[:4]}, missing "
                              f"{missing[:4]}); check lora_target_modules and the base model")


def _write_checkpoint(tmp: Path, iteration: int, model: Any, optimizer: Any, scheduler: Any,
                      tokenizer: Any, generator: Any, sampler_state: Any, trainer_state: dict,
                      extra: dict[str, Part], save_optim: bool, save_rng: bool, adapter_only: bool,
                      files: dict[str, Any]) -> None:
    _save_part(tmp, model, optimizer, scheduler, tokenizer, save_optim, adapter_only)
    for name, obj in files.items():
        _torch_save(obj, tmp / name)
    for name, part in extra.items():
        _save_part(tmp / name, part.model, part.optimizer, part.scheduler, None, save_optim)
    if save_rng:
        _torch_save(rng_state(generator), tmp / "rng.pt")
    if sampler_state is not None:
        _torch_save(sampler_state, tmp / "sampler.pt")
    state = {"format": FORMAT, **trainer_state, "iteration": iteration, "sampler_saved": sampler_state is not None}
    _write_text(tmp / STATE_FILE, json.dumps(state, indent=2, sort_keys=True) + "\n")
    make_readable(tmp)


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
    had_old = os.path.lexists(target)
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
        _remove_path(aside)  # a moved-aside symlink is unlinked, its target untouched


def _remove_stale_temps(save_dir: Path) -> None:
    """Remove temporary dirs (and moved-aside links) left by a save that was killed; a run holds
    the save dir's lock (:mod:`posttrain.trainers.session`), so no live save owns them."""
    for path in save_dir.glob(".iter_*.tmp*"):
        _remove_path(path)


def save_checkpoint(save_dir: str | Path, iteration: int, model: Any, optimizer: Any = None,
                    scheduler: Any = None, *, tokenizer: Any = None,
                    generator: torch.Generator | None = None, sampler_state: Any = None,
                    trainer_state: dict | None = None, extra: dict[str, Part] | None = None,
                    save_optim: bool = True, save_rng: bool = True,
                    keep_last: int | None = None, adapter_only: bool = False,
                    files: dict[str, Any] | None = None) -> Path:
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
        adapter_only: a PEFT (LoRA) model's adapter alone (``lora_ckpt_filter``); without it the
            frozen base model is saved in ``base/``, so the directory stands alone.
        files: more objects, each ``torch.save``-d to its file name (the loop's in-flight samples).
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
                          sampler_state, trainer_state, extra or {}, save_optim, save_rng, adapter_only, files or {})
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


def is_hf_model_dir(path: str | Path) -> bool:
    """True when ``path`` holds a ``config.json`` and weights (safetensors, or ``pytorch_model.bin``)."""
    path = Path(path)
    return (path / "config.json").is_file() and bool(_weight_files(path))


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of an HF dir: from the shard index, else model.safetensors, else all."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({type(err).__name__}: {err}); "
                                  f"the file is corrupt or truncated") from None
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
            try:
                part = load_file(str(f))
            except Exception as err:  # noqa: BLE001  (SafetensorError, OSError: a corrupt or partial file)
                raise CheckpointError(_unreadable_weights(f, err)) from None
            _check_finite(f, part)
            state.update(part)
        return state
    if (path / "pytorch_model.bin").is_file():
        state = _load_file(path / "pytorch_model.bin")
        _check_finite(path / "pytorch_model.bin", state)
        return state
    raise CheckpointError(f"{path}: no *.safetensors or pytorch_model.bin weights found")


def _unreadable_weights(path: Path, err: BaseException) -> str:
    return (f"{path}: not a readable safetensors file ({type(err).__name__}: {err}); it is truncated or "
            f"corrupt (an interrupted copy?)")


def _check_finite(path: Path, tensors: dict[str, Any]) -> None:
    """CheckpointError naming ``path`` and its first tensor holding NaN or inf."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"{path}: tensor {name} holds {bad} NaN/inf values of {tensor.numel()}; "
                                  f"these weights are unusable (saved after the training diverged, or corrupt)")


def check_model_files(path: str | Path) -> None:
    """Cheap checks of an HF model or checkpoint dir before a model is built from it:
    ``config.json`` is a JSON object and every safetensors file has a valid, complete header.
    Raises :class:`CheckpointError` naming the first bad file."""
    from safetensors import safe_open

    path = Path(path)
    config = path / "config.json"
    if config.is_file():
        _read_json_object(config)
    for f in _weight_files(path):
        if f.suffix != ".safetensors":
            continue
        if not f.is_file():
            raise CheckpointError(f"{f} is missing (named by {path / 'model.safetensors.index.json'})")
        try:
            with safe_open(str(f), framework="pt") as handle:
                handle.keys()
        except Exception as err:  # noqa: BLE001  (SafetensorError: truncated, bad header)
            raise CheckpointError(_unreadable_weights(f, err)) from None


def _read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}); the file is corrupt or truncated") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}; the file is corrupt")
    return data


def read_trainer_state(path: str | Path) -> dict:
    """``trainer_state.json`` of checkpoint dir ``path``, checked: a JSON object with an integer
    ``iteration`` >= 0 (and ``consumed_samples`` if present)."""
    file = Path(path) / STATE_FILE
    state = _read_json_object(file)
    for key in ("iteration", "consumed_samples"):
        value = state.get(key, 0 if key == "consumed_samples" else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{file}: {key} must be an integer >= 0, found {value!r}; the file is corrupt")
    return state


def verify_checkpoint(path: str | Path, *, optim: bool = True, rng: bool = True, weights: bool = True) -> None:
    """Read every file of checkpoint dir ``path`` (``iter_*``) that a resume will load, and raise
    :class:`CheckpointError` naming the first one that is missing, truncated or corrupt:
    trainer_state.json, config.json, the weights (also NaN/inf), optimizer/scheduler (``optim``),
    rng.pt (``rng``), sampler.pt, and the extra parts' (critic/) files."""
    from safetensors import safe_open

    path = Path(path)
    read_trainer_state(path)
    parts = [path] + sorted(p.parent for p in path.glob("*/config.json"))
    for part in parts:
        check_model_files(part)
        if weights:
            for f in _weight_files(part):
                if f.suffix != ".safetensors":
                    continue
                try:
                    with safe_open(str(f), framework="pt") as handle:
                        for name in handle.keys():
                            _check_finite(f, {name: handle.get_tensor(name)})
                except CheckpointError:
                    raise
                except Exception as err:  # noqa: BLE001
                    raise CheckpointError(_unreadable_weights(f, err)) from None
        if optim:
            for name in ("optimizer.pt", "scheduler.pt"):
                if (part / name).is_file():
                    _load_file(part / name, mmap=True)
    if rng and (path / "rng.pt").is_file():
        _load_file(path / "rng.pt")
    if (path / "sampler.pt").is_file():
        _load_file(path / "sampler.pt")


def earlier_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete ``iter_*`` dirs next to ``checkpoint_dir`` (an ``iter_*`` dir) with a lower
    iteration, newest first: where a resume can fall back to when ``checkpoint_dir`` is corrupt."""
    checkpoint_dir = Path(checkpoint_dir)
    m = _ITER_RE.match(checkpoint_dir.name)
    if m is None:
        return [p for _, p in reversed(list_checkpoints(checkpoint_dir))]
    return [p for it, p in reversed(list_checkpoints(checkpoint_dir.parent)) if it < int(m.group(1))]


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Copy the HF weights saved in ``path`` into ``model`` in place (tied weights allowed); into a
    PEFT (LoRA) model, its adapter (the base is the one it was built on)."""
    path = Path(path)
    if hasattr(model, "peft_config"):
        load_adapter_weights(path, model)
        return
    config = path / "config.json"
    if config.is_file():
        _read_json_object(config)
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


def _load_file(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` (weights only) of a checkpoint file; CheckpointError naming it when it cannot be
    read. ``mmap``: map the tensors instead of reading them (a cheap check of a large file)."""
    is_zip = False
    try:
        is_zip = zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=(mmap and is_zip) or None)
    except Exception as err:  # noqa: BLE001  (UnpicklingError, zip errors, EOF: a corrupt or partial file)
        if not is_zip and not isinstance(err, OSError):
            why = "its bytes are not a complete zip archive as torch.save writes"
        else:
            text = str(err).strip()
            first = text.splitlines()[0].split(". ")[0] if text else type(err).__name__
            why = f"{type(err).__name__}: {first}"
        raise CheckpointError(f"{path}: cannot be read ({why}); the file is corrupt or truncated") from None


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
    from posttrain.models.mcore.layout import is_mcore_checkpoint

    if is_mcore_checkpoint(load_dir):
        from posttrain.models.mcore.cache import hf_cache_for

        return hf_cache_for(load_dir), False
    latest = find_latest(load_dir)
    if latest is not None:
        return latest, True
    if is_hf_model_dir(load_dir):
        return load_dir, False
    hint = " It holds a GGUF file: convert it to an HF directory first." if any(load_dir.glob("*.gguf")) else ""
    found = ", ".join(sorted(p.name for p in load_dir.iterdir())[:8]) or "nothing"
    raise CheckpointError(f"load: no checkpoint in {load_dir} (it holds: {found}): expected a posttrain save "
                          f"directory ({TRACKER}, iter_XXXXXXX/), an HF model directory (config.json + "
                          f"*.safetensors) or a Megatron checkpoint (release/ or iter_*/ with mp_rank_*/; "
                          f"`posttrain convert` also converts it explicitly).{hint}")


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
        try:
            set_rng_state(_load_file(path / "rng.pt"), generator)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as err:
            raise CheckpointError(f"{path / 'rng.pt'}: not the RNG states posttrain saves ({type(err).__name__}: "
                                  f"{err}); the file is corrupt. Set no_load_rng: true to resume without it") from None
    state = read_trainer_state(path)
    state.pop("format", None)
    sampler_saved = state.pop("sampler_saved", True)  # older checkpoints always had one
    sampler = path / "sampler.pt"
    if sampler.is_file():
        state["sampler_state"] = _load_file(sampler)
    elif not sampler_saved:
        state["sampler_state"] = None
    elif no_load_rng:
        log.warning("%s is missing; no_load_rng is set, so the data sampler restarts at the first batch of "
                    "epoch 0 (prompts already trained on are drawn again)", sampler)
        state["sampler_state"] = None
    else:
        raise CheckpointError(f"{sampler} is missing, so the data order cannot be resumed; set no_load_rng: "
                              f"true to resume anyway with the sampler restarted at epoch 0 (prompts already "
                              f"trained on are drawn again)")
    state["checkpoint_dir"] = str(path)
    return state
