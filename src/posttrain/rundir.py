"""A run's directories and its starting checkpoint, checked before any work: every directory the
run writes exists and is writable, is locked for the run's lifetime (two runs never write one
save or output directory), and holds no other run's checkpoints or metrics; the checkpoint it
resumes from is read in full before any model is built (:func:`checked_start`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.checkpoint import (TRACKER, CheckpointLoad, check_model_files, earlier_checkpoints, list_checkpoints,
                                  read_trainer_state, resolve_checkpoint, verify_checkpoint)
from posttrain.errors import CheckpointError, ConfigError
from posttrain.models.mcore.checks import check_mcore_checkpoint

log = logging.getLogger(__name__)

LOCK_NAME = ".posttrain.lock"
METRICS_FILES = ("metrics.jsonl", "eval.jsonl")


class DirLock:
    """An exclusive ``fcntl.flock`` on ``<directory>/.posttrain.lock``, held for a run's lifetime,
    so two runs never write the same save or output directory. The kernel drops the lock when the
    process dies, so a crashed run leaves no stale lock (the file itself stays, unlocked)."""

    def __init__(self, directory: Path, what: str):
        self.path = directory / LOCK_NAME
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
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def writable_dir(directory: Path, what: str) -> None:
    """Create ``directory`` if needed and check that a file can be created in it; ConfigError
    naming ``what`` (the config key) otherwise. Run at start-up, before any iteration."""
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{what} {directory} is an existing file, not a directory; give a directory path")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{what} {directory}: cannot create the directory ({err})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".posttrain-write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(f"{what} {directory} is not writable ({err}); fix its permissions or choose "
                          f"another directory") from None


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
    writable_dir(run_dir, dirs.run_dir_key)
    for key, directory in dirs.log_dirs.items():
        writable_dir(directory, key)
    if save is not None:
        writable_dir(save, "actor_config.save")
    if critic_save is not None:
        writable_dir(critic_save, "critic_config.save")
    locks: list[DirLock] = []
    try:
        locks.append(DirLock(run_dir, dirs.run_dir_key))
        if save is not None and not _same_dir(save, run_dir):
            locks.append(DirLock(save, "actor_config.save"))
        if critic_save is not None and not _same_dir(critic_save, run_dir):
            locks.append(DirLock(critic_save, "critic_config.save"))
        check_dir_contents(dirs)
    except BaseException:
        for lock in locks:
            lock.release()
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
    if megatron:
        if check_mcore_checkpoint(source):
            return Start(source)
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


def _previous_start(bad: Path, error: CheckpointError, candidates: list[Path], load: CheckpointLoad,
                    load_previous_on_corruption: bool) -> Start:
    """The newest of ``candidates`` that verifies, when asked to fall back; else the error."""
    if not candidates:
        raise error
    if not load_previous_on_corruption:
        raise CheckpointError(f"{error}. The previous complete checkpoint {candidates[0]} exists: rerun with "
                              f"`posttrain train --load-previous-on-corruption ...` to resume from it (or set "
                              f"actor_config.load={candidates[0]})") from None
    for previous in candidates:
        try:
            verify_checkpoint(previous, optim=load.restores_optimizer, rng=load.restores_rng)
        except CheckpointError as err2:
            log.warning("the earlier checkpoint %s is not usable either: %s", previous, err2)
            continue
        log.warning("%s cannot be loaded (%s); resuming from the previous complete checkpoint %s instead "
                    "(--load-previous-on-corruption)", bad, error, previous)
        return Start(str(previous), read_trainer_state(previous) if not load.finetune else {})
    raise CheckpointError(f"{error}. No earlier checkpoint next to it is complete and readable") from None
