"""Where shipped files (configs, model yamls, templates, tools files) are found.

They are package data (``posttrain/configs``, read through :mod:`importlib.resources`), so an
installed wheel finds them from any directory; in a clone, ``src/posttrain/configs`` is a link to
``configs/`` at the top, which the wheel build copies. A user's own ``$POSTTRAIN_CONFIGS`` or ``./configs`` comes first (:func:`configs_dir`), and a
relative path that a config writes (``configs/model/templates.json``) is read from the current
directory first, then from those folders (:func:`shipped_file`).
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # a clone's top folder (docs/, tests/): for the dev tools


def packaged_configs() -> Path:
    """The configs shipped inside the package."""
    return Path(str(files("posttrain") / "configs"))


def configs_dir() -> Path:
    """The ``configs/`` folder: ``$POSTTRAIN_CONFIGS``, else ``./configs``, else the shipped one."""
    env = os.environ.get("POSTTRAIN_CONFIGS")
    if env:
        return Path(env)
    local = Path.cwd() / "configs"
    if local.is_dir():
        return local
    return packaged_configs()


def shipped_file(path: str | Path) -> Path:
    """``path`` as given (absolute, or from the current directory) when it exists; else a relative
    ``configs/...`` path in :func:`configs_dir`, then in the shipped configs; else ``path`` unchanged
    (the caller says it is missing)."""
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    parts = path.parts
    if parts and parts[0] == "configs":
        for root in (configs_dir(), packaged_configs()):
            candidate = root.joinpath(*parts[1:])
            if candidate.exists():
                return candidate
    return path
