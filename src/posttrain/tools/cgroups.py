"""A cgroup per sandbox call: one memory limit and one process limit over all of the call's processes.

:func:`find_cgroups` looks, once, for a place where this process (root) may create cgroups with
the ``memory`` and ``pids`` controllers:

* **cgroup v2**: ``<the cgroup2 mount>/posttrain-sandbox/`` (the mount's root must have ``memory``
  and ``pids`` in its ``cgroup.subtree_control``, as systemd hosts do; a container whose
  ``/sys/fs/cgroup`` is read-only, or whose root cgroup holds processes, cannot);
* **cgroup v1**: ``<the memory hierarchy>/<this process's memory cgroup>/posttrain-sandbox/`` (and
  the same under the ``pids`` hierarchy, when there is one).

It tries a cgroup there (creates it, writes the limits, removes it) and returns a
:class:`CgroupHost`, or None with the reason. Each call then gets a :class:`CallCgroup`: created
with its limits, the sandbox's first process moved into it before it forks anything, and killed and
removed afterwards. Leftovers of a killed parent (empty ``call-<pid>-<n>`` cgroups whose pid is
gone) are removed by the next :func:`find_cgroups`.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

BASE = "posttrain-sandbox"
_calls = itertools.count()


@dataclass(frozen=True)
class CgroupHost:
    """Where the calls' cgroups go: ``version`` 2 (one ``dirs["memory"]`` that also holds pids) or 1
    (a directory per controller; ``pids`` may be absent)."""

    version: int
    dirs: dict[str, Path]

    @property
    def limits_processes(self) -> bool:
        """Whether the calls' cgroups limit the process count (pids controller)."""
        return self.version == 2 or "pids" in self.dirs

    def describe(self) -> str:
        controllers = " and ".join(sorted(self.dirs)) if self.version == 1 else "memory and pids"
        return f"cgroup v{self.version} ({controllers}, under {self.dirs['memory']})"

    def new_call(self, memory_bytes: int, max_processes: int) -> CallCgroup:
        return CallCgroup(self, f"call-{os.getpid()}-{next(_calls)}", memory_bytes, max_processes)


class CallCgroup:
    """One call's cgroup(s), created with their limits; :meth:`remove` kills what is left and deletes them."""

    def __init__(self, host: CgroupHost, name: str, memory_bytes: int, max_processes: int):
        self.host = host
        self.paths = {c: d / name for c, d in host.dirs.items()}
        try:
            for path in self.paths.values():
                path.mkdir()
            memory = self.paths["memory"]
            if host.version == 2:
                _put(memory / "memory.max", "max" if memory_bytes >= 2**62 else memory_bytes)
                if (memory / "memory.swap.max").exists():
                    _put(memory / "memory.swap.max", 0)
                _put(memory / "pids.max", max_processes)
            else:
                limit = -1 if memory_bytes >= 2**62 else memory_bytes
                _put(memory / "memory.limit_in_bytes", limit)
                if (memory / "memory.memsw.limit_in_bytes").exists():
                    _put(memory / "memory.memsw.limit_in_bytes", limit)
                if "pids" in self.paths:
                    _put(self.paths["pids"] / "pids.max", max_processes)
        except OSError:
            self.remove()
            raise

    def attach(self, pid: int) -> None:
        """Moves process ``pid`` (not yet forked) into the call's cgroup(s)."""
        for path in self.paths.values():
            _put(path / "cgroup.procs", pid)

    def oom_kills(self) -> int:
        """How many processes the kernel killed for going past the memory limit."""
        memory = self.paths["memory"]
        name = "memory.events" if self.host.version == 2 else "memory.oom_control"
        try:
            for line in (memory / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, wait_s: float = 5.0) -> None:
        """Kills every process left in the cgroup(s) and removes them; never raises."""
        deadline = time.monotonic() + wait_s
        for path in self.paths.values():
            while path.exists():
                try:
                    pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
                    for pid in pids:
                        _kill(pid)
                    if not pids:
                        path.rmdir()
                except OSError:
                    pass
                if path.exists():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)


def find_cgroups() -> tuple[CgroupHost | None, str]:
    """Where the calls' cgroups can go here (tried once), or None and why not."""
    mounts = _cgroup_mounts()
    reasons = []
    for find in (_find_v2, _find_v1):
        try:
            host = find(mounts)
            host.new_call(64 * 2**20, 4).remove()
            _remove_leftovers(host)
            return host, host.describe()
        except _Unusable as e:
            reasons.append(str(e))
        except OSError as e:
            reasons.append(f"{e.filename or 'cgroup'}: {e.strerror}")
    return None, "; ".join(reasons)


class _Unusable(Exception):
    pass


def _find_v2(mounts: list[tuple[str, str, str]]) -> CgroupHost:
    roots = [point for point, fstype, _ in mounts if fstype == "cgroup2"]
    if not roots:
        raise _Unusable("no cgroup v2 mount")
    root = Path(roots[0])
    have = set(_read(root / "cgroup.controllers").split())
    enabled = set(_read(root / "cgroup.subtree_control").split())
    missing = [c for c in ("memory", "pids") if c not in have or c not in enabled]
    if missing:
        where = "are not v2 controllers here" if not have >= set(missing) else "are not enabled in its subtree_control"
        raise _Unusable(f"cgroup v2 at {root}: {' and '.join(missing)} {where}")
    base = root / BASE
    base.mkdir(exist_ok=True)
    if not {"memory", "pids"} <= set(_read(base / "cgroup.subtree_control").split()):
        _put(base / "cgroup.subtree_control", "+memory +pids")
    return CgroupHost(2, {"memory": base})


def _find_v1(mounts: list[tuple[str, str, str]], own: dict[str, str] | None = None) -> CgroupHost:
    """``own``: this process's cgroup path per v1 controller (default: from /proc/self/cgroup)."""
    if own is None:
        own = {}
        for line in _read(Path("/proc/self/cgroup")).splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                own[controller] = path
    dirs = {}
    for controller in ("memory", "pids"):
        points = [p for p, fstype, options in mounts if fstype == "cgroup" and controller in options.split(",")]
        if points and controller in own:
            dirs[controller] = Path(points[0], own[controller].lstrip("/"), BASE)
    if "memory" not in dirs:
        raise _Unusable("no cgroup v1 memory hierarchy")
    for path in dirs.values():
        path.mkdir(exist_ok=True)
    return CgroupHost(1, dirs)


def _cgroup_mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, super options) of the cgroup mounts."""
    mounts = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] in ("cgroup", "cgroup2"):
            mounts.append((fields[4], fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""))
    return mounts


def _remove_leftovers(host: CgroupHost) -> None:
    """Empty call cgroups of posttrain processes that are gone (killed before they could clean up)."""
    for base in host.dirs.values():
        for path in base.glob("call-*-*"):
            pid = path.name.split("-")[1]
            if pid.isdigit() and not Path("/proc", pid).exists():
                try:
                    path.rmdir()
                except OSError:
                    pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise _Unusable(f"{path}: {e.strerror}") from e


def _put(path: Path, value: object) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
