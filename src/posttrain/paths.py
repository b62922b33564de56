"""Where shipped files (configs, templates) are found."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def configs_dir() -> Path:
    """The ``configs/`` folder: ``$POSTTRAIN_CONFIGS``, else ``./configs``, else the project's own."""
    env = os.environ.get("POSTTRAIN_CONFIGS")
    if env:
        return Path(env)
    local = Path.cwd() / "configs"
    if local.is_dir():
        return local
    return PROJECT_ROOT / "configs"
