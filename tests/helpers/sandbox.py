"""The code sandbox's private mounts, for tests that pick host paths the sandbox must not reach."""

from __future__ import annotations

from pathlib import Path

PRIVATE_MOUNTS = ("/tmp", "/var/tmp", "/dev/shm", "/run")  # fresh and empty inside the sandbox


def under_a_private_mount(path: Path) -> bool:
    """Whether ``path`` lies under one of the sandbox's private mounts (hidden there, not read-only)."""
    return any(path == Path(m) or Path(m) in path.parents for m in PRIVATE_MOUNTS)
