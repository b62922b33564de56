"""Finding and checking checkpoints before anything loads them: the complete ``iter_*`` directories
of a save directory, the latest one, what a load path resolves to, and a full read of every file
a resume will load (a corrupt file is a :class:`~posttrain.errors.CheckpointError` naming it)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch

from posttrain.checkpoint.files import ITER_RE, STATE_FILE, TRACKER, iter_dir_name
from posttrain.errors import CheckpointError


def _previous(save_dir: Path) -> Path | None:
    try:
        return find_latest(save_dir)
    except CheckpointError:
        return None


def list_checkpoints(save_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete ``iter_*`` directories (with trainer_state.json), oldest first."""
    found = []
    for path in Path(save_dir).glob("iter_*"):
        m = ITER_RE.match(path.name)
        if m and (path / STATE_FILE).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


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
    from safetensors.torch import load_file  # lazy: plan imports checkpoint/, reads no weights

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
    from safetensors import safe_open  # lazy: plan imports checkpoint/, reads no weights

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
    rng.pt (``rng``), every other ``*.pt`` (sampler.pt, in_flight.pt, partial_rollout.pt), and the
    extra parts' (critic/) files."""
    from safetensors import safe_open  # lazy: plan imports checkpoint/, reads no weights

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
    skipped = set() if rng else {"rng.pt"}
    for file in sorted(path.glob("*.pt")):  # rng, sampler, and the loop's (in_flight.pt, partial_rollout.pt)
        if file.name not in skipped and file.name not in ("optimizer.pt", "scheduler.pt"):
            _load_file(file)


def earlier_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete ``iter_*`` dirs next to ``checkpoint_dir`` (an ``iter_*`` dir) with a lower
    iteration, newest first: where a resume can fall back to when ``checkpoint_dir`` is corrupt."""
    checkpoint_dir = Path(checkpoint_dir)
    m = ITER_RE.match(checkpoint_dir.name)
    if m is None:
        return [p for _, p in reversed(list_checkpoints(checkpoint_dir))]
    return [p for it, p in reversed(list_checkpoints(checkpoint_dir.parent)) if it < int(m.group(1))]


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
    if is_hf_model_dir(load_dir):
        return load_dir, False
    hint = " It holds a GGUF file: convert it to an HF directory first." if any(load_dir.glob("*.gguf")) else ""
    found = ", ".join(sorted(p.name for p in load_dir.iterdir())[:8]) or "nothing"
    raise CheckpointError(f"load: no checkpoint in {load_dir} (it holds: {found}): expected a posttrain save "
                          f"directory ({TRACKER}, iter_XXXXXXX/), an HF model directory (config.json + "
                          f"*.safetensors) or a Megatron checkpoint (release/ or iter_*/ with mp_rank_*/; "
                          f"`posttrain convert` converts it explicitly).{hint}")


def _load_file(path: Path, mmap: bool = False) -> Any:
    """``torch.load`` (weights only) of a checkpoint file; CheckpointError naming it when it cannot be
    read. ``mmap``: map the tensors instead of reading them (a cheap check of a large file)."""
    is_zip = False
    try:
        is_zip = zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=(mmap and is_zip) or None)
    except Exception as err:  # noqa: BLE001  (UnpicklingError, zip errors, EOF: a corrupt or partial file)
        if is_zip and "weights only load failed" in str(err).lower() and "unsupported global" in str(err).lower():
            what = next((line.strip() for line in str(err).splitlines() if "GLOBAL" in line), "")
            raise CheckpointError(f"{path}: refused: it holds pickled Python objects, not only tensors and plain "
                                  f"data ({what[:200]}), and unpickling them could run code. posttrain writes plain "
                                  f"data only (such files of earlier posttrain versions are refused too); resume from "
                                  f"another checkpoint, or start anew from its weights with finetune=true") from None
        if not is_zip and not isinstance(err, OSError):
            why = "its bytes are not a complete zip archive as torch.save writes"
        else:
            text = str(err).strip()
            first = text.splitlines()[0].split(". ")[0] if text else type(err).__name__
            why = f"{type(err).__name__}: {first}"
        raise CheckpointError(f"{path}: cannot be read ({why}); the file is corrupt or truncated") from None
