"""A sandbox that runs untrusted, model-written Python for a "code interpreter" tool.

:func:`run_python` runs the code as ``main.py`` in a fresh sandbox and returns what it printed
(stdout and stderr together, truncated) in a :class:`SandboxResult`. It never raises for anything
the code does: a timeout, a crash, a memory error, a kill by a signal and too much output all
become ``SandboxResult.error``, and :attr:`SandboxResult.text` is what the model is shown.

Design: what is enforced by what
--------------------------------
The parent must be root. Each call starts :mod:`posttrain.tools.sandbox_launcher` (with the
sandbox's interpreter, ``-I -S``) in a session of its own, the code on its stdin; the launcher
creates new mount, network, pid, IPC and UTS namespaces (and a user namespace where the host allows
it, mapping uid 65534 only), and its pid 1 builds the sandbox and forks the code:

* **Unprivileged code**: uid/gid 65534 ("nobody"), no supplementary groups, no capabilities
  (bounding set emptied, so exec cannot regain any), ``no_new_privs`` (setuid programs are inert).
* **The host's files read-only** (every mount, ``mount_setattr``), with private, empty, size-limited
  tmpfs on ``/tmp`` (the working directory and ``HOME``), ``/var/tmp``, ``/dev/shm`` and ``/run``
  (so host sockets under ``/run`` are hidden), a ``/proc`` of its own pid namespace and a ``/sys``
  of its own network namespace. Nothing it writes outlives the call, and concurrent calls cannot
  see each other.
* **No network**: the network namespace has only a loopback interface, and it is down; a seccomp
  filter refuses ``socket(AF_UNIX)`` (path-bound host sockets are not covered by the namespace),
  io_uring and the kernel keyrings, and every syscall of a foreign ABI.
* **Processes**: host processes are invisible; pid 1 reaps orphans, ignores the signals the code
  may send it, keeps its capabilities and is not dumpable, so the code can neither ptrace it nor
  open its memory. When the code exits or the wall clock runs out, everything in the namespace
  is killed (the parent kills the session; pid 1 dies with the launcher, the launcher with the
  parent's thread).
* **Limits**: per process (``setrlimit``, pid 1's too but CPU): CPU time ``cpu_s``, address space
  ``memory_mb``, :data:`MAX_PROCESSES` processes and threads, :data:`MAX_FILE_BYTES` per file (the
  output included), :data:`MAX_OPEN_FILES`, no core dumps. Per call: ``cpu_s`` over all its
  processes (pid 1 adds them up); where root may create cgroups (:mod:`posttrain.tools.cgroups`),
  ``memory_mb`` over all its processes and tmpfs files, and the process count (else per process
  only, and :func:`detect_sandbox` says so). The wall clock ``timeout_s`` is the parent's.
* **Environment**: only PATH, HOME=/tmp, LANG=C.UTF-8, PYTHONDONTWRITEBYTECODE and
  PYTHONIOENCODING; ``-I -S`` also ignores PYTHON* variables, the user's site directory and
  site-packages: the standard library only.
* **Output**: stdout and stderr go to one anonymous temporary file of the parent (``-u``: in the
  order written); the parent reads at most ``max_output_bytes + 1`` bytes of it. The code's exit
  status comes from pid 1 over a pipe, so ``sys.exit(137)`` is not mistaken for a kill.

Interpreter: ``sys.executable`` when uid 65534 can run it, else the system ``python3``.
:func:`detect_sandbox` (cached) probes each way to build the sandbox, keeps the first that works and
logs one line saying what is isolated and what is not; where none works (not root, namespaces
forbidden as in a default Docker container) it raises :class:`~posttrain.errors.ConfigError`: the
tool refuses rather than run code unsandboxed. Not isolated: the code can read the host's
world-readable files; the kernel is shared (this stops accidents and ordinary escapes, not a
kernel exploit: use a VM such as gVisor or Firecracker for that). docs/tools.md has the details.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from posttrain.errors import ConfigError
from posttrain.tools import cgroups
from posttrain.tools.base import ToolConfigError

log = logging.getLogger(__name__)

SANDBOX_UID = SANDBOX_GID = 65534  # the unprivileged user ("nobody") that runs the code
MAX_PROCESSES = 16
"""Processes and threads of one call (the cgroup's pids.max where there is one, and RLIMIT_NPROC)."""
SHARED_NPROC = 1024
"""RLIMIT_NPROC without a user namespace but with a pids cgroup: uid 65534's processes are counted
over the whole host, so the per-call limit is the cgroup's and this only caps all calls together."""
MAX_FILE_BYTES = 16 * 2**20
"""RLIMIT_FSIZE: largest file the code may write, its output included."""
MAX_OPEN_FILES = 64  # RLIMIT_NOFILE
TMPFS_BYTES = 64 * 2**20
"""Size of each private tmpfs (/tmp, /var/tmp, /dev/shm); /run gets 1 MiB."""
MAX_CODE_BYTES = 2**20
"""The longest code a call runs (UTF-8 bytes)."""
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
RANGES = {"timeout_s": (0.0, 3600.0), "cpu_s": (0.0, 3600.0), "memory_mb": (32, 2**30),
          "max_output_bytes": (1, MAX_FILE_BYTES)}
"""Accepted values of the limits: seconds in (low, high], whole numbers in [low, high]."""
READONLY_METHOD = "setattr"
"""How the host's mounts are made read-only: ``setattr`` (``mount_setattr``, Linux 5.12+, else as
``remount``) or ``remount`` (mount by mount)."""
_LAUNCHER = (Path(__file__).parent / "sandbox_launcher.py").read_text(encoding="utf-8")
_ENV = {"PATH": SANDBOX_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8"}

_PROBE = """\
import errno, os, socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    net = "connected"
except OSError as e:
    net = errno.errorcode.get(e.errno, str(e))
print(os.getuid(), os.getgid(), net, os.getcwd())
"""
_PROBE_OK = f"{SANDBOX_UID} {SANDBOX_GID} ENETUNREACH /tmp"


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one :func:`run_python` call."""

    output: str
    """stdout and stderr, interleaved as written, truncated to ``max_output_bytes``."""
    exit_code: int | None
    """The code's exit status; -N if killed by signal N; None if it timed out or never ran."""
    timed_out: bool
    error: str | None
    """What went wrong (timeout, limit, crash, nonzero exit, truncated output), or None."""

    @property
    def text(self) -> str:
        """What the model is shown: the output, then ``[error: ...]`` on a line of its own."""
        if self.error is None:
            return self.output
        sep = "" if not self.output or self.output.endswith("\n") else "\n"
        return f"{self.output}{sep}[error: {self.error}]"


@dataclass(frozen=True)
class SandboxSetup:
    """How this host builds the sandbox (found by :func:`detect_sandbox`)."""

    python: str
    """The interpreter of the launcher and of the code (uid 65534 must be able to run it)."""
    user_namespace: bool
    """True: the launcher runs as 65534 and creates a user namespace; False: it runs as root."""
    cgroups: cgroups.CgroupHost | None = None
    """Where each call's cgroup goes; None: memory and processes are limited per process only."""
    cgroup_note: str = ""
    """Why there is no cgroup (when ``cgroups`` is None)."""
    seccomp: bool = True
    """Whether the seccomp filter (Unix sockets, io_uring, keyrings) applies on this architecture."""

    def popen_user(self) -> dict[str, object]:
        """``Popen`` arguments that switch to the sandbox user before exec'ing the launcher."""
        if not self.user_namespace:
            return {}
        return {"user": SANDBOX_UID, "group": SANDBOX_GID, "extra_groups": []}

    def describe(self) -> str:
        """One line: what is isolated here, and what is not."""
        how = "a user namespace" if self.user_namespace else "namespaces created as root (no user namespace)"
        unix = ("Unix sockets, io_uring and keyrings refused (seccomp)" if self.seccomp else
                f"Unix sockets, io_uring and keyrings NOT refused (no seccomp filter for {os.uname().machine})")
        if self.cgroups:
            memory = f"memory_mb over all of a call's processes ({self.cgroups.describe()})"
        else:
            memory = f"memory_mb per process only, not per call (no usable cgroup: {self.cgroup_note})"
        if self.user_namespace or (self.cgroups and self.cgroups.limits_processes):
            processes = f"{MAX_PROCESSES} processes per call"
        else:
            processes = f"{MAX_PROCESSES} processes shared by concurrent calls (uid {SANDBOX_UID}'s RLIMIT_NPROC)"
        return (f"code interpreter sandbox: {self.python} as uid {SANDBOX_UID} without capabilities, in {how} "
                f"with its own pid, network, mount, IPC and UTS namespaces; host files read-only; private "
                f"/tmp, /var/tmp, /dev/shm and /run; no network; {unix}; limits: {memory}, {processes}")


def check_limits(*, timeout_s: float, cpu_s: float, memory_mb: int, max_output_bytes: int) -> None:
    """:class:`~posttrain.tools.base.ToolConfigError` (a ConfigError) naming the first value out of
    :data:`RANGES`: ``key: must be ..., not value``."""
    for key, value in (("timeout_s", timeout_s), ("cpu_s", cpu_s), ("memory_mb", memory_mb),
                       ("max_output_bytes", max_output_bytes)):
        low, high = RANGES[key]
        if key.endswith("_s"):
            ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
                  and low < value <= high)
            want = f"a finite number of seconds > {low:g} and <= {high:g}"
        else:
            ok = not isinstance(value, bool) and isinstance(value, int) and low <= value <= high
            want = f"a whole number from {low} to {high}"
        if not ok:
            raise ToolConfigError(key, f"must be {want}, not {value!r}")


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: float = 5.0, memory_mb: int = 512,
               max_output_bytes: int = 16384) -> SandboxResult:
    """Runs ``code`` in the sandbox and returns its output; never raises for what the code does.

    Raises :class:`ConfigError` if this host cannot sandbox (see :func:`detect_sandbox`) or a limit
    is out of :data:`RANGES` (see :func:`check_limits`).
    """
    check_limits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    return _run(code, detect_sandbox(), timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                max_output_bytes=max_output_bytes)[0]


_detected: SandboxSetup | ConfigError | None = None
_detecting = threading.Lock()


def detect_sandbox() -> SandboxSetup:
    """The first way to build the sandbox that works here, probed once and cached (so is a failure).

    Logs what is isolated (and what is not) once; raises :class:`ConfigError` when nothing works.
    """
    global _detected
    with _detecting:  # the runner's threads may all start with the first calls
        if _detected is None:
            try:
                _detected = _probe_setups()
            except ConfigError as e:
                _detected = e
            else:
                less = _detected.cgroups is None or not _detected.seccomp
                log.log(logging.WARNING if less else logging.INFO, "%s", _detected.describe())
    if isinstance(_detected, ConfigError):
        raise ConfigError(str(_detected))
    return _detected


def _probe_setups() -> SandboxSetup:
    why = ("the code interpreter runs model-written code as uid 65534 in its own mount, network and pid "
           "namespaces (Linux, started as root) and will not run it unsandboxed")
    if not sys.platform.startswith("linux"):
        raise ConfigError(f"The code interpreter needs Linux namespaces: {why}.")
    if os.geteuid() != 0:
        raise ConfigError(f"The code interpreter must be started as root (to switch to uid 65534): {why}.")
    host, note = cgroups.find_cgroups()
    pythons = [p for p in dict.fromkeys([sys.executable, shutil.which("python3", path=SANDBOX_PATH)]) if p]
    tried = []
    for python in pythons:
        for user_namespace in (True, False):
            setup = SandboxSetup(python, user_namespace, host, note)
            result, applied = _run(_PROBE, setup, timeout_s=20, cpu_s=5, memory_mb=512, max_output_bytes=2000)
            if result.output.strip() == _PROBE_OK and result.error is None and applied:
                return SandboxSetup(python, user_namespace, host, note, seccomp=bool(applied.get("seccomp")))
            kind = "user namespace" if user_namespace else "namespaces as root"
            tried.append(f"{python} ({kind}): {result.text.strip()[-300:]!r}")
    raise ConfigError(f"The code interpreter needs Linux namespaces, but none of the ways to sandbox works "
                      f"here: {why}. Tried:\n" + "\n".join(tried))


def _run(code: str, setup: SandboxSetup, *, timeout_s: float, cpu_s: float, memory_mb: int,
         max_output_bytes: int) -> tuple[SandboxResult, dict | None]:
    """The call, and what the launcher reported having set up (None if it did not get that far)."""
    source = code.encode("utf-8", errors="surrogatepass")
    problem = _code_problem(code, source)
    if problem:
        return SandboxResult("", None, False, problem), None
    cpu = max(1, math.ceil(cpu_s))
    file_bytes = max(MAX_FILE_BYTES, max_output_bytes + 1)
    shared = not setup.user_namespace and setup.cgroups is not None and setup.cgroups.limits_processes
    limits = {"cpu": cpu, "as": memory_mb * 2**20, "nproc": SHARED_NPROC if shared else MAX_PROCESSES,
              "fsize": file_bytes, "nofile": MAX_OPEN_FILES}
    try:
        cgroup = setup.cgroups.new_call(memory_mb * 2**20, MAX_PROCESSES + 2) if setup.cgroups else None
    except OSError as e:
        return _failed(f"could not create the call's cgroup ({e})"), None
    try:
        records, timed_out, size, data = _launch(source, setup, cgroup, limits, timeout_s, max_output_bytes)
        oom_kills = cgroup.oom_kills() if cgroup else 0
    except OSError as e:
        return _failed(f"the call failed on the host ({e})"), None
    finally:
        if cgroup:
            cgroup.remove()
    setup_error = next((r["error"] for r in records if "error" in r), None)
    if setup_error is not None:
        log.warning("code interpreter sandbox: %s", setup_error)
        return _failed(setup_error), None
    applied = next((r["setup"] for r in records if "setup" in r), None)
    ended = next((r for r in records if "status" in r), None)
    errors = []
    if size > max_output_bytes:
        data = data[:max_output_bytes]
        more = "at least " if size >= file_bytes else ""
        errors.append(f"output truncated to its first {max_output_bytes} bytes (of {more}{size})")
    exit_code = None if ended is None else os.waitstatus_to_exitcode(ended["status"])
    cpu_used = float(ended["cpu"]) if ended and ended.get("cpu_limit_hit") else 0.0
    outcome = _describe(exit_code, timed_out, oom_kills, setup, timeout_s=timeout_s, cpu=cpu,
                        cpu_used=cpu_used, memory_mb=memory_mb, file_bytes=file_bytes)
    if outcome:
        errors.append(outcome)
    return SandboxResult(output=data.decode("utf-8", errors="replace"), exit_code=exit_code,
                         timed_out=timed_out, error="; ".join(errors) or None), applied


def _launch(source: bytes, setup: SandboxSetup, cgroup: cgroups.CallCgroup | None, limits: dict,
            timeout_s: float, max_output_bytes: int) -> tuple[list[dict], bool, int, bytes]:
    """Runs the launcher: (its status records, timed out?, output size, the output's first bytes)."""
    status_r, status_w = os.pipe()
    go_r, go_w = os.pipe() if cgroup else (-1, -1)
    config = {"parent_pid": os.getpid(), "status_fd": status_w, "go_fd": go_r, "user_namespace": setup.user_namespace,
              "uid": SANDBOX_UID, "gid": SANDBOX_GID, "tmpfs_bytes": TMPFS_BYTES, "env": _ENV, "limits": limits,
              "readonly": READONLY_METHOD}
    timed_out = False
    try:
        with tempfile.TemporaryFile() as code_file, tempfile.TemporaryFile() as out:
            code_file.write(source)
            code_file.seek(0)
            try:
                proc = subprocess.Popen([setup.python, "-I", "-S", "-c", _LAUNCHER, json.dumps(config)],
                                        stdin=code_file, stdout=out, stderr=subprocess.STDOUT, cwd="/", env=_ENV,
                                        pass_fds=[fd for fd in (status_w, go_r) if fd >= 0],
                                        start_new_session=True, **setup.popen_user())
            finally:
                for fd in (status_w, go_r):
                    if fd >= 0:
                        os.close(fd)
            try:
                if cgroup:
                    cgroup.attach(proc.pid)
                    os.write(go_w, b"g")
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if proc.returncode is None:  # timeout, a failed attach, or an exception here (KeyboardInterrupt)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            records = _read_records(status_r)
            size = os.fstat(out.fileno()).st_size
            out.seek(0)
            return records, timed_out, size, out.read(max_output_bytes + 1)
    finally:
        for fd in (status_r, go_w):
            if fd >= 0:
                os.close(fd)


def _code_problem(code: str, source: bytes) -> str | None:
    """Why ``code`` cannot run at all (too long, a NUL byte), or None."""
    if len(source) > MAX_CODE_BYTES:
        return f"the code is {len(source):,} bytes long; the sandbox runs at most {MAX_CODE_BYTES:,}"
    nul = code.find("\0")
    if nul >= 0:
        line = code.count("\n", 0, nul) + 1
        column = nul - (code.rfind("\n", 0, nul) + 1) + 1
        return (f"the code holds a NUL character (\\x00) at line {line}, column {column}; Python source cannot "
                f"hold one: remove it (write '\\x00' inside a string)")
    return None


def _failed(why: str) -> SandboxResult:
    return SandboxResult("", None, False, f"the sandbox could not run the code: {why}")


def _read_records(fd: int, wait_s: float = 2.0) -> list[dict]:
    """The launcher's JSON lines from the status pipe (read to its end: every writer is gone)."""
    data = b""
    poller = select.poll()  # not select(): a big process (a Ray worker) may hold fds past FD_SETSIZE
    poller.register(fd, select.POLLIN)
    while poller.poll(wait_s * 1000):
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    records = []
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _describe(exit_code: int | None, timed_out: bool, oom_kills: int, setup: SandboxSetup, *, timeout_s: float,
              cpu: int, cpu_used: float, memory_mb: int, file_bytes: int) -> str | None:
    memory = (f"the call went past its memory limit of {memory_mb} MB (all its processes together)"
              if oom_kills else None)
    if timed_out:
        return f"timed out after {timeout_s:g} s (wall clock); the process and its children were killed"
    if exit_code is None:
        return f"the sandbox ended without the code's exit status{'; ' + memory if memory else ''}"
    if exit_code >= 0:
        status = None if exit_code == 0 else f"exited with status {exit_code}"
        if memory:  # a child was killed, the main program carried on
            return "; ".join(filter(None, [status, f"a process was killed: {memory}"]))
        return status
    sig = -exit_code
    if sig == signal.SIGKILL and cpu_used:
        return f"CPU-time limit of {cpu} s reached (all the call's processes together, {cpu_used:.1f} s); killed"
    if sig == signal.SIGXCPU:
        return f"CPU-time limit of {cpu} s reached; killed"
    if sig == signal.SIGXFSZ:
        return f"file-size limit reached (the output or a file grew past {file_bytes} bytes); killed"
    if sig == signal.SIGKILL:
        if memory:
            return f"killed: {memory}"
        return ("killed by SIGKILL (not by a limit of the sandbox: by the code itself"
                + (")" if setup.cgroups else ", or by the host when its memory ran out)"))
    try:
        return f"killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"killed by signal {sig}"
