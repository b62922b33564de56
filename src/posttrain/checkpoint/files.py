"""The checkpoint's vocabulary and its low-level writers: file names, the ``iter_XXXXXXX`` directory
name, an extra trained :class:`Part`, what a role loads (:class:`CheckpointLoad`), durable writes
and file modes, and the RNG states a checkpoint carries."""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.files import current_umask

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.json"
FORMAT = "posttrain-checkpoint/1"
ITER_RE = re.compile(r"^iter_(\d{7,})$")


@dataclass(frozen=True)
class CheckpointLoad:
    """What a role loads (``load``), and what of a full checkpoint it restores: everything unless
    ``finetune`` (weights only, iteration 0), the optimizer unless ``no_load_optim``, the RNG unless
    ``no_load_rng`` (the seed's keys, section 8.2)."""

    load: str | None = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False

    @property
    def restores_optimizer(self) -> bool:
        return not (self.no_load_optim or self.finetune)

    @property
    def restores_rng(self) -> bool:
        return not (self.no_load_rng or self.finetune)


@dataclass
class Part:
    """An extra trained module saved in its own subdirectory (e.g. the PPO critic)."""

    model: Any
    optimizer: Any = None
    scheduler: Any = None


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


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
