"""Where a command writes its results, checked before the work starts.

A command never replaces a file it was not asked to (``--force`` says so), never writes into a
directory given where a file is expected, and writes through a temporary file renamed at the end,
so a failure leaves neither half a file nor a stray temporary behind (and a symlink planted at the
output path is replaced, not written through).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterable

from posttrain.errors import ConfigError
from posttrain.files import os_reason

PROBE_BYTES = 4096  # the write test writes one block: a disk with no block free fails it before the work


def check_writable_dir(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and check that a file of one block can be written in it
    (ConfigError naming ``what``); the directories it created are removed again when it cannot."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{what}: {directory} is an existing file, not a directory")
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".posttrain-write-test-", dir=directory)
    except OSError as err:
        _remove_empty(missing)
        raise ConfigError(f"{what}: cannot write in {directory} ({os_reason(err)})") from None
    try:
        os.write(fd, b"\0" * PROBE_BYTES)
        os.fsync(fd)
    except OSError as err:
        os.close(fd)
        os.unlink(probe)
        _remove_empty(missing)
        raise ConfigError(f"{what}: cannot write in {directory} ({os_reason(err)})") from None
    os.close(fd)
    os.unlink(probe)


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories in ``created`` (deepest first) that are still empty."""
    for directory in created:
        with contextlib.suppress(OSError):
            directory.rmdir()


def refuse_overwriting_inputs(outputs: dict[str, str | Path | None], inputs: dict[str, Iterable[str | Path]]) -> None:
    """Before any work: no two outputs (``flag -> path``) may be one file, and no output may be (or
    resolve to, through symlinks) a file the command reads (``what -> paths``), with or without
    ``--force``: the command would replace its own input."""
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if not path:
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(f"{flag} {path} and {seen[real]} name the same file; one would replace the other. "
                              f"Give them different paths")
        seen[real] = f"{flag} {path}"
        for what, paths in inputs.items():
            for source in paths:
                if os.path.exists(source) and os.path.realpath(source) == real:
                    raise ConfigError(f"{flag} {path} is {what} ({source}), which this command reads; writing "
                                      f"there would replace it (also with --force). Give another path")


def check_output_file(path: str | Path, flag: str = "--output", *, force: bool = False,
                      same_as: str | Path | None = None) -> Path:
    """Check, before any work, that the file ``path`` (given with ``flag``) can be written: not a
    directory, not an existing file unless ``force`` (or it is ``same_as``, the command's own input
    that it rewrites in place), and its folder is writable. Returns ``path``."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is an existing directory; give a file path, e.g. {path / 'results.json'}")
    in_place = same_as is not None and path.exists() and Path(same_as).exists() and path.samefile(same_as)
    if os.path.lexists(path) and not (force or in_place):
        raise ConfigError(f"{flag} {path} already exists; give a new file name, "
                          f"or --force to replace it")
    check_writable_dir(path.parent, f"{flag} {path}")
    return path
