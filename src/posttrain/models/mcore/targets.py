"""Where ``posttrain convert`` writes: checked before any work, staged, published, cleaned up.

Convert writes into a staging directory ``<parent>/.posttrain-convert-<label>-<random>/`` that
holds a marker file with the writer's pid (:data:`STAGING_MARKER`), and renames the result into
place when it is complete. Each run first removes the staging directories of dead convert runs in
the same parent (their name *and* marker say they are convert's), so a SIGKILL'd run's files do not
stay behind. A failed run removes its staging directory and any directory it created for the
target, so the target is left as it was found.

Every output convert publishes carries a manifest, :data:`MANIFEST` (``release/.posttrain-convert.json``
of hf -> mg, ``<dir>/.posttrain-convert.json`` of an HF output) listing the files it wrote.
``--force`` replaces only those: a ``release/`` without it, or a file in an HF target that convert
would write but did not write before, is refused by name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from posttrain.errors import CheckpointError, ConfigError

STAGING_PREFIX = ".posttrain-convert-"
STAGING_MARKER = ".posttrain-convert-staging"
MANIFEST = ".posttrain-convert.json"
_WEIGHTS = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json)$")
_FULL_HINTS = ("no space left", "os error 28", "unexpected pos", "file write failed", "pytorchstreamwriter failed")


# ---- staging -------------------------------------------------------------------------------------

@contextlib.contextmanager
def staging(parent: Path, label: str, target: Path | None = None) -> Iterator[Path]:
    """A staging directory in ``parent`` (created if needed), removed on exit whatever happens; on
    failure the directories created for it are removed too. An OSError or a full disk while writing
    becomes one :class:`CheckpointError` naming ``target``."""
    parent, target = Path(parent), Path(target or parent)
    created = _make_dirs(parent, target)
    try:
        remove_stale_staging(parent)
        tmp = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{label.strip('.')}-", dir=parent))
        (tmp / STAGING_MARKER).write_text(f"{os.getpid()}\n", encoding="utf-8")
    except OSError as err:
        _remove_created(created)
        raise CheckpointError(f"cannot write in {parent} for {target} ({err.strerror or err}); "
                              f"check that it is writable and has free space") from None
    done = False
    try:
        yield tmp
        done = True
    except Exception as err:
        if isinstance(err, (CheckpointError, ConfigError)) or not _is_write_error(err):
            raise
        raise write_failed(err, tmp, target) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            _remove_created(created)


def _is_write_error(err: BaseException) -> bool:
    if isinstance(err, OSError):
        return True
    return any(h in str(err).lower() for h in _FULL_HINTS)


def write_failed(err: BaseException, tmp: Path, target: Path) -> CheckpointError:
    """The error for a write that failed: a full disk said as such, with what was written."""
    written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    text = str(err).lower()
    full = getattr(err, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(h in text for h in _FULL_HINTS)
    if full:
        after = f" after {written / 2**20:.1f} MiB" if written >= 2**20 else ""
        return CheckpointError(f"the disk is full: writing {target} ran out of space{after} (No space left on "
                               f"device); nothing was left behind. Free disk space or give a --save-dir on another disk")
    return CheckpointError(f"writing {target} failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                           f"nothing was left behind")


def check_free_space(target: Path, needed: int) -> None:
    """Refuse up front when ``target`` (its nearest existing ancestor) cannot be written, or its disk
    has less than ``needed`` bytes free."""
    existing = Path(target)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        raise CheckpointError(f"cannot write in {existing} for {target} (a read-only file system, or no write "
                              f"permission); give a --save-dir you can write")
    free = _free_bytes(target)
    if free is not None and free < needed:
        raise CheckpointError(f"the disk is full: writing {target} needs about {needed / 2**20:.1f} MiB but only "
                              f"{free / 2**20:.1f} MiB are free; free disk space or give a --save-dir on another disk")


def _free_bytes(path: Path) -> int | None:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _make_dirs(parent: Path, target: Path) -> list[Path]:
    """Create ``parent`` and its missing ancestors; the ones created, deepest first."""
    missing = []
    p = parent
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"--save-dir {target}: {parent} is an existing file; give a directory") from None
    except OSError as err:
        where = "" if parent == target else f" for {target}"
        raise CheckpointError(f"cannot create {parent}{where} ({err.strerror or err}: a part of the path is a file "
                              f"or cannot be written); give another --save-dir") from None
    return missing


def _remove_created(created: list[Path]) -> None:
    for d in created:
        with contextlib.suppress(OSError):
            d.rmdir()  # only if still empty


def remove_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging directories left in ``parent`` by convert runs that died (SIGKILL, power
    loss): named :data:`STAGING_PREFIX`* and holding a marker whose pid is no longer running."""
    removed = []
    for d in parent.glob(f"{STAGING_PREFIX}*"):
        marker = d / STAGING_MARKER
        if d.is_symlink() or not d.is_dir() or not marker.is_file():
            continue
        try:
            pid = int(marker.read_text(encoding="utf-8").strip())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


# ---- manifests -----------------------------------------------------------------------------------

def write_manifest(directory: Path, names: Iterable[str]) -> None:
    (directory / MANIFEST).write_text(json.dumps({"written_by": "posttrain convert", "files": sorted(names)},
                                                 indent=1) + "\n", encoding="utf-8")


def read_manifest(directory: Path) -> set[str] | None:
    """The files a previous convert wrote in ``directory``; None when it has no readable manifest."""
    path = directory / MANIFEST
    if path.is_symlink() or not path.is_file():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return {f for f in files if isinstance(f, str) and "/" not in f} if isinstance(files, list) else None


def is_converts_release(release: Path) -> bool:
    """A ``release/`` that posttrain convert wrote (a real directory holding its manifest)."""
    return release.is_dir() and not release.is_symlink() and read_manifest(release) is not None


def foreign_files(out_dir: Path, names: Iterable[str] | None = None) -> list[str]:
    """The files in ``out_dir`` that an HF output would replace but that no convert wrote there:
    ``names`` (the files staged), or else any weights, index, config or tokenizer file."""
    from posttrain.models.mcore.hf_files import TOKENIZER_FILES  # lazy: torch

    ours = read_manifest(out_dir) or set()
    clashing = set(names) if names is not None else None
    out = []
    for f in sorted(out_dir.iterdir()):
        would_write = (f.name in clashing) if clashing is not None else (
            bool(_WEIGHTS.match(f.name)) or f.name in TOKENIZER_FILES)
        if (would_write or _WEIGHTS.match(f.name)) and f.name not in ours and f.name != MANIFEST:
            out.append(f.name)
    return out


def publish_hf(tmp: Path, out_dir: Path) -> None:
    """Move the staged HF files of ``tmp`` into ``out_dir`` with a manifest, readable by all (0644
    files, 0755 directories). An existing ``out_dir`` keeps every file convert did not write; the
    files of the previous conversion (its manifest) that this one does not write are removed."""
    from posttrain.checkpoint import make_readable  # lazy: torch

    with contextlib.suppress(FileNotFoundError):
        (tmp / STAGING_MARKER).unlink()
    names = sorted(f.name for f in tmp.iterdir())
    write_manifest(tmp, names)
    make_readable(tmp)
    if not out_dir.exists():
        tmp.rename(out_dir)
        tmp.mkdir()  # staging() removes it
        return
    clash = foreign_files(out_dir, names)
    if clash:
        raise ConfigError(f"{out_dir / clash[0]} was not written by posttrain convert; --force replaces only the "
                          f"files listed in {out_dir / MANIFEST}. Move it away or give another directory")
    for old in (read_manifest(out_dir) or set()) - set(names):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            (out_dir / old).unlink()
    for name in names:
        if name != MANIFEST:
            os.replace(tmp / name, out_dir / name)
    os.replace(tmp / MANIFEST, out_dir / MANIFEST)
