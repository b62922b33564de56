"""A run's directories and its starting checkpoint, checked before any work: every directory the
run writes exists and is writable, is locked for the run's lifetime (two runs never write one
save or output directory), and holds no other run's checkpoints or metrics; the checkpoint it
resumes from is read in full before any model is built (:func:`checked_start`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.checkpoint import (TRACKER, CheckpointLoad, check_model_files, earlier_checkpoints, list_checkpoints,
                                  read_trainer_state, resolve_checkpoint, verify_checkpoint)
from posttrain.errors import CheckpointError, ConfigError
from posttrain.checkpoint.files import ITER_RE
from posttrain.checkpoint.verify import _load_file
from posttrain.models.mcore import mcore_files
from posttrain.models.mcore.checks import check_mcore_checkpoint
from posttrain.models.mcore.mcore_files import is_mcore_checkpoint, iteration_dir

log = logging.getLogger(__name__)

LOCK_NAME = ".posttrain.lock"
METRICS_FILES = ("metrics.jsonl", "eval.jsonl")


class DirLock:
    """An exclusive ``fcntl.flock`` on ``<directory>/.posttrain.lock``, held for a run's lifetime,
    so two runs never write the same save or output directory. The kernel drops the lock when the
    process dies, so a crashed run leaves no stale lock (the file itself stays, unlocked)."""

    def __init__(self, directory: Path, what: str, created_dirs: list[Path] | None = None):
        self.path = directory / LOCK_NAME
        self.created_dirs = list(created_dirs or [])  # made for this run (removed by abandon() if still empty)
        self.created_file = not os.path.lexists(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
        except OSError as err:
            raise ConfigError(f"{what} {directory}: cannot create the lock file {self.path} ({err})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            by = f" (process {holder})" if holder.isdigit() else ""
            raise ConfigError(f"{what} {directory} is in use by another run{by}: it holds the lock {self.path}. "
                              f"Wait for that run to end, or give this run another directory") from None
        self.fd: int | None = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as err:
            self.abandon()
            why = "the disk is full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else err.strerror or str(err)
            raise ConfigError(f"{what} {directory}: cannot write the lock file {self.path} ({why}); free space "
                              f"there or choose another directory") from None

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def abandon(self) -> None:
        """For a run refused before it wrote anything: remove the lock file (while still holding it)
        if this run created it, release it, and remove the directories this run created that are
        still empty, so the directories are left as they were found."""
        if self.fd is not None and self.created_file:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.release()
        remove_created_dirs(self.created_dirs)


def remove_created_dirs(created: list[Path]) -> None:
    """``rmdir`` the directories a run created (deepest first) while they are empty."""
    for directory in reversed(created):
        with contextlib.suppress(OSError):
            directory.rmdir()


def writable_dir(directory: Path, what: str) -> list[Path]:
    """Create ``directory`` if needed and check that a file can be created in it; ConfigError
    naming ``what`` (the config key) otherwise. Run at start-up, before any iteration. Returns the
    directories it created, outermost first (a refused run removes them again)."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{what} {directory} is an existing file, not a directory; give a directory path")
    missing = [d for d in (directory, *directory.parents) if not os.path.lexists(d)][::-1]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        remove_created_dirs([d for d in missing if d.is_dir()])
        raise ConfigError(f"{what} {directory}: cannot create the directory ({err})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".posttrain-write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        remove_created_dirs(missing)
        raise ConfigError(f"{what} {directory} is not writable ({err}); fix its permissions or choose "
                          f"another directory") from None
    return missing


def _same_dir(a: str | Path, b: str | Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def resumes_from(load: CheckpointLoad, save: str | Path) -> bool:
    """Whether a role that loads ``load`` continues the checkpoints in ``save``: its ``load`` is that
    directory (or one of its ``iter_*``) and ``finetune`` is off."""
    if not load.load or load.finetune:
        return False
    return _same_dir(load.load, save) or _same_dir(Path(load.load).parent, save)


def checkpoints_in(save: Path) -> list[str]:
    """The tracker and ``iter_*`` entries of ``save``."""
    names = [TRACKER] if os.path.lexists(save / TRACKER) else []
    return names + sorted(p.name for p in save.glob("iter_*"))


def _why_not_resumed(load: CheckpointLoad) -> str:
    if not load.load:
        return "actor_config.load is not set"
    if load.finetune:
        return "actor_config.finetune is true: it would start again at iteration 0"
    return f"actor_config.load is {load.load}"


@dataclass(frozen=True)
class RunDirs:
    """The directories a run writes: ``run_dir`` (named ``run_dir_key`` in messages), the actor's
    ``save`` (with what the actor loads), the critic's own ``critic_save`` (with what the critic
    loads), and the log directories by their config key."""

    run_dir: Path
    run_dir_key: str
    save: Path | None = None
    actor: CheckpointLoad = CheckpointLoad()
    critic_save: Path | None = None
    critic: CheckpointLoad = CheckpointLoad()
    log_dirs: dict[str, Path] = field(default_factory=dict)

    @property
    def resumes_in_place(self) -> bool:
        """Whether this run continues the checkpoints in its own ``save`` directory."""
        return self.save is not None and resumes_from(self.actor, self.save)


def claim_run_dirs(dirs: RunDirs) -> list[DirLock]:
    """Check and lock the run's directories before any work, and refuse to write into a directory
    that holds another run's checkpoints or metrics (a run only continues its own, when it resumes
    from its save directory). Returns the locks to release at the end of the run."""
    run_dir, save, critic_save = dirs.run_dir, dirs.save, dirs.critic_save
    made: list[Path] = []  # the directories created here, outermost first
    locks: list[DirLock] = []
    try:
        made += writable_dir(run_dir, dirs.run_dir_key)
        for key, directory in dirs.log_dirs.items():
            made += writable_dir(directory, key)
        if save is not None:
            made += writable_dir(save, "actor_config.save")
        if critic_save is not None:
            made += writable_dir(critic_save, "critic_config.save")
        locks.append(DirLock(run_dir, dirs.run_dir_key, made))
        made = []  # the first lock removes them when the run is refused (DirLock.abandon)
        if save is not None and not _same_dir(save, run_dir):
            locks.append(DirLock(save, "actor_config.save"))
        if critic_save is not None and not _same_dir(critic_save, run_dir):
            locks.append(DirLock(critic_save, "critic_config.save"))
        check_dir_contents(dirs)
    except BaseException:
        for lock in reversed(locks):
            lock.abandon()
        remove_created_dirs(made)
        raise
    return locks


def check_dir_contents(dirs: RunDirs) -> None:
    """Refuse directories that hold another run's checkpoints or metrics (a run only continues its
    own, when it resumes from its save directory). Reads only: ``posttrain plan`` runs it too."""
    run_dir, save, critic_save = dirs.run_dir, dirs.save, dirs.critic_save
    if critic_save is not None and not _same_dir(critic_save, run_dir):
        _refuse_foreign_checkpoints(critic_save, dirs.critic, "critic_config")
    in_place = dirs.resumes_in_place and bool(checkpoints_in(save))
    if save is not None and not in_place:
        found = checkpoints_in(save)
        if found:
            shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
            raise ConfigError(
                f"actor_config.save {save} already holds checkpoints ({shown}), and this run would not resume "
                f"from them ({_why_not_resumed(dirs.actor)}); it refuses to overwrite them. Give a new save "
                f"directory or remove that one; to continue those checkpoints set actor_config.load={save} and "
                f"actor_config.finetune=false")
    if not in_place:
        found = [n for n in METRICS_FILES if os.path.lexists(run_dir / n)]
        if found:
            raise ConfigError(
                f"{dirs.run_dir_key} {run_dir} already holds the metrics of an earlier run ({', '.join(found)}); "
                f"this run would mix its rows with them. Give another output directory or remove those "
                f"files (a run that resumes from its own save directory continues them)")


def _refuse_foreign_checkpoints(save: Path, load: CheckpointLoad, section: str) -> None:
    """``save`` may hold checkpoints only when this role resumes from them (``load`` is ``save``
    or one of its ``iter_*``, ``finetune`` off)."""
    found = checkpoints_in(save)
    if found and not resumes_from(load, save):
        raise ConfigError(f"{section}.save {save} already holds checkpoints ({', '.join(found[:4])}), and this run "
                          f"would not resume from them; give a new save directory, or set {section}.load={save} "
                          f"and {section}.finetune=false to continue them")


@dataclass(frozen=True)
class Start:
    """Where a run starts: ``source``, the path its policy loads (the config's, or with
    ``--load-previous-on-corruption`` the previous complete checkpoint; None when the config names
    no directory), and the trainer state saved there (empty unless a full posttrain checkpoint)."""

    source: str | None
    saved_state: dict = field(default_factory=dict)


def checked_start(source: str | None, load: CheckpointLoad, *, megatron: bool = False,
                  load_previous_on_corruption: bool = False) -> Start:
    """Read every file the run will load from ``source`` (the actor's ``load``, else its tokenizer
    directory) before any model is built: a corrupt checkpoint is a :class:`CheckpointError` naming
    the file and the previous complete checkpoint. With ``load_previous_on_corruption`` the run
    starts from that previous checkpoint instead (a warning names both). ``megatron``: the Megatron
    backend's workers read a Megatron checkpoint shard by shard, so here its shards are only
    checked to be complete (the hf backend converts it once, when it is loaded)."""
    if not source or not Path(source).is_dir():
        return Start(source)  # a missing path is reported by the policy's model_source()
    if megatron and is_mcore_checkpoint(source):
        return _megatron_start(Path(source), load, load_previous_on_corruption)
    try:
        path, full = resolve_checkpoint(source)
    except CheckpointError as err:  # the tracker names a missing or incomplete iter_*, or no model there
        if not load.load:
            return Start(source)  # a tokenizer-only directory: reported when the model is built
        bad, error, candidates = Path(source), err, [p for _, p in reversed(list_checkpoints(source))]
    else:
        try:
            verify_checkpoint(path, optim=load.restores_optimizer, rng=load.restores_rng) if full \
                else check_model_files(path)
            return Start(source, read_trainer_state(path) if full and not load.finetune else {})
        except CheckpointError as err:
            if not full:
                raise
            bad, error, candidates = path, err, earlier_checkpoints(path)
    return _previous_start(bad, error, candidates, load, load_previous_on_corruption)


def _megatron_start(source: Path, load: CheckpointLoad, load_previous_on_corruption: bool) -> Start:
    """:func:`checked_start` of a Megatron checkpoint (the megatron backend's workers load it shard by
    shard): every file checked here (:func:`~posttrain.checkpoint.dist.verify_megatron_checkpoint`),
    with the same fallback to the previous complete iteration."""
    try:
        it_dir = iteration_dir(source)
    except CheckpointError as err:  # the tracker names a missing iteration, or is garbage
        bad, error, candidates = source, err, earlier_megatron_iterations(source)
    else:
        try:
            verify_megatron_checkpoint(it_dir)
            return Start(str(source))
        except CheckpointError as err:
            if not load.load:
                raise
            bad, error, candidates = it_dir, err, earlier_megatron_iterations(it_dir)

    def verify(path: Path) -> dict:
        verify_megatron_checkpoint(path)
        return {}
    return _previous_start(bad, error, candidates, load, load_previous_on_corruption, verify)


def _previous_start(bad: Path, error: CheckpointError, candidates: list[Path], load: CheckpointLoad,
                    load_previous_on_corruption: bool, verify=None) -> Start:
    """The newest of ``candidates`` that verifies (``verify(path)`` returns its trainer state; by
    default a posttrain checkpoint's), when asked to fall back; else the error."""
    if verify is None:
        def verify(path: Path) -> dict:
            verify_checkpoint(path, optim=load.restores_optimizer, rng=load.restores_rng)
            return read_trainer_state(path) if not load.finetune else {}
    if not candidates:
        if load_previous_on_corruption:
            raise CheckpointError(f"{error}. --load-previous-on-corruption: there is no earlier checkpoint next to "
                                  f"it to fall back to") from None
        raise error
    if not load_previous_on_corruption:
        raise CheckpointError(f"{error}. The previous complete checkpoint {candidates[0]} exists: rerun with "
                              f"`posttrain train --load-previous-on-corruption ...` to resume from it (or set "
                              f"actor_config.load={candidates[0]})") from None
    for previous in candidates:
        try:
            state = verify(previous)
        except CheckpointError as err2:
            log.warning("the earlier checkpoint %s is not usable either: %s", previous, err2)
            continue
        log.warning("%s cannot be loaded (%s); resuming from the previous complete checkpoint %s instead "
                    "(--load-previous-on-corruption)", bad, error, previous)
        return Start(str(previous), state)
    raise CheckpointError(f"{error}. No earlier checkpoint next to it is complete and readable") from None


# ---- the Megatron backend's checkpoints ----------------------------------------------------------------
# Checked before its workers load them: the ``torch_dist`` format's metadata, common entries and shards
# (every ``__*.distcp`` file its metadata names is present and long enough for the bytes it indexes;
# the metadata and the objects pickled in the shards hold no code, since torch and Megatron unpickle
# those with plain pickle), and a legacy one's rank files; and the earlier complete iterations next to
# it, where ``--load-previous-on-corruption`` falls back. A truncated shard would otherwise surface as
# an anonymous ``EOFError`` in one Ray worker. Bytes flipped inside a shard keep its size and are not
# detected here (``dist_checkpointing`` keeps no checksums).
def _dist_parts(it_dir: Path) -> list[Path]:
    """The iteration dir and its model subdirectories (``critic/``) in the torch_dist format."""
    return [it_dir] + sorted(d for d in it_dir.iterdir() if d.is_dir() and mcore_files.is_dist_checkpoint(d))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` file (torch.distributed.checkpoint reads it with plain ``pickle``,
    which runs any code in it) allowing only its own classes, ``torch.Size`` and dtypes."""

    def find_class(self, module: str, name: str):
        import torch

        obj = super().find_class(module, name) if module.split(".")[0] in ("torch", "collections", "builtins",
                                                                          "pathlib") else None
        allowed = (module.startswith("torch.distributed.checkpoint.") and isinstance(obj, type)) or \
            (module == "torch" and (name == "Size" or isinstance(obj, torch.dtype))) or \
            (module, name) in {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                               ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"),
                               ("pathlib", "PurePosixPath")}  # StorageMeta.checkpoint_id may be a path
        if not allowed:
            raise pickle.UnpicklingError(f"unsupported global {module}.{name}")
        return obj


def read_dist_metadata(part: Path):
    """The ``.metadata`` of the torch_dist checkpoint ``part``, unpickled safely (refusing code)."""
    metadata_file = part / mcore_files.DIST_METADATA
    try:
        with open(metadata_file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        if "unsupported global" in str(err):
            raise CheckpointError(f"{metadata_file}: refused: it holds pickled Python objects other than a "
                                  f"checkpoint's metadata ({err}), and unpickling them could run code") from None
        raise CheckpointError(f"{metadata_file}: not readable ({err}); the checkpoint is corrupt or "
                              f"truncated") from None
    except Exception as err:  # noqa: BLE001 - EOFError, ValueError...: a damaged file
        raise CheckpointError(f"{metadata_file}: not readable ({type(err).__name__}: {err}); the checkpoint is "
                              f"corrupt or truncated") from None


def check_pickled_items(part: Path, metadata) -> None:
    """The pickled objects inside the shards (Megatron's ``_extra_state`` and RNG states; the workers'
    ``dist_checkpointing.load`` unpickles them with ``weights_only=False``) read with
    ``weights_only=True``: pickled code is refused, naming the shard."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    objects = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in objects:
            continue
        shard = part / info.relative_path
        with open(shard, "rb") as f:
            f.seek(int(info.offset))
            blob = f.read(int(info.length))
        try:
            with torch.serialization.safe_globals(mcore_files.safe_globals()):
                torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - UnpicklingError, zip errors: name the shard
            first = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"{shard}: its entry {index.fqn} cannot be read safely ({type(err).__name__}: "
                                  f"{first}); the shard is corrupt, or holds pickled code (refused)") from None


def check_dist_shards(part: Path) -> None:
    """Every shard file the ``.metadata`` of ``part`` indexes exists and holds the indexed bytes, and
    the objects pickled in them are plain data."""
    metadata_file = part / mcore_files.DIST_METADATA
    metadata = read_dist_metadata(part)
    try:
        storage = metadata.storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception as err:  # noqa: BLE001 - name the file whatever torch raises
        raise CheckpointError(f"{metadata_file}: not readable ({type(err).__name__}: {err}); the checkpoint is "
                              f"corrupt or truncated") from None
    for name, size in sorted(needed.items()):
        shard = part / name
        try:
            have = os.stat(shard).st_size
        except OSError:
            raise CheckpointError(f"{shard} is missing: {metadata_file} indexes {size} bytes in it; the checkpoint "
                                  f"is incomplete (an interrupted copy?)") from None
        if have < size:
            raise CheckpointError(f"{shard}: {have} bytes, but {metadata_file} indexes {size}; the shard is "
                                  f"truncated (an interrupted copy, or a full disk)")
    check_pickled_items(part, metadata)


def verify_megatron_checkpoint(it_dir: str | Path) -> None:
    """Check the Megatron iteration dir ``it_dir`` in full before any worker loads it (see the
    module doc); :class:`CheckpointError` names the first bad file."""
    import torch  # lazy: plan imports checkpoint/

    it_dir = Path(it_dir)
    if mcore_files.is_dist_checkpoint(it_dir):
        for part in _dist_parts(it_dir):  # posttrain's own reads first: pickled code is refused, never run
            with torch.serialization.safe_globals(mcore_files.safe_globals()):
                _load_file(part / mcore_files.DIST_COMMON)
            check_dist_shards(part)
    check_mcore_checkpoint(it_dir)  # common.pt and .metadata readable; a legacy one's rank files


def megatron_iterations(save_dir: str | Path) -> list[tuple[int, Path]]:
    """The ``iter_*`` dirs of ``save_dir`` that hold a Megatron iteration, oldest first."""
    found = []
    for path in Path(save_dir).glob("iter_*"):
        m = ITER_RE.match(path.name)
        if m and path.is_dir() and mcore_files.is_mcore_checkpoint(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def earlier_megatron_iterations(it_dir: str | Path) -> list[Path]:
    """The Megatron iterations next to ``it_dir`` with a lower number, newest first (all of a save
    dir's iterations when ``it_dir`` is not an ``iter_*`` dir)."""
    it_dir = Path(it_dir)
    m = ITER_RE.match(it_dir.name)
    if m is None:
        return [p for _, p in reversed(megatron_iterations(it_dir))]
    return [p for it, p in reversed(megatron_iterations(it_dir.parent)) if it < int(m.group(1))]
