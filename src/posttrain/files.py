"""Whole-file writes: a temporary file next to the target, renamed over it at the end.

A reader never sees half a file, a symlink planted at the target is replaced rather than written
through, and a failed write (a full disk) leaves the target as it was and no temporary behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import IO, Callable

from posttrain.errors import PosttrainError


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


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], None],
                 failed: Callable[[Path, OSError], Exception] | None = None) -> None:
    """Call ``write(f)`` on a temporary binary file next to ``path`` (with the mode a plain
    ``open()`` gives), then rename it to ``path``. On an OSError the temporary file is removed,
    ``path`` is left as it was, and ``failed(path, err)`` (default :func:`write_failed`) is raised."""
    path = Path(path)
    failed = failed or write_failed
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise failed(path, err) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise failed(path, err) from None
        raise


def write_text_atomic(path: str | Path, text: str,
                      failed: Callable[[Path, OSError], Exception] | None = None) -> None:
    """:func:`write_atomic` of ``text`` in UTF-8."""
    write_atomic(path, lambda f: f.write(text.encode("utf-8")), failed)


def write_failed(path: Path, err: OSError) -> Exception:
    """The default error of a failed :func:`write_atomic`: names the file and the reason."""
    return PosttrainError(f"{path}: cannot write it ({os_reason(err)}); nothing was written there"
                          + (f" (the earlier {path.name} is unchanged)" if path.exists() else ""))


def os_reason(err: OSError) -> str:
    """Why an OSError happened, in words a user acts on."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full: free some space or write somewhere else"
    return err.strerror or str(err)
