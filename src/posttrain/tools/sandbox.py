"""A sandbox that runs untrusted, model-written Python for a "code interpreter" tool.

:func:`run_python` writes the code to ``main.py`` in a fresh temporary directory, runs it in a
separate process and returns what it printed (stdout and stderr together, truncated) in a
:class:`SandboxResult`. It never raises for anything the code does: a timeout, a crash, a memory
error, a kill by a signal and too much output all become ``SandboxResult.error``, and
:attr:`SandboxResult.text` is what the model is shown.

Design: what is enforced by what
--------------------------------
The parent must be root. It starts, in a new session (its own process group)::

    unshare [--user --map-current-user] --net --pid --fork --kill-child --mount-proc \\
        <python> -I -S -c <launcher> <limits>   ->  pid 1: launcher  ->  pid 2: python main.py

* **Unprivileged user** (uid/gid 65534, "nobody", no supplementary groups, no capabilities). This
  is what makes ``RLIMIT_NPROC`` apply (Linux ignores it for root) and what keeps the code out of
  the host's files: it can read only world-readable files and write only where anyone may.
  Preferred: ``Popen`` switches to 65534 (``user=``, ``group=``, ``extra_groups=[]``; no
  ``preexec_fn``, so this is safe in threaded parents) before exec'ing ``unshare``, which creates
  a *user* namespace mapping only 65534 to itself, owning the other namespaces; each sandbox then
  has its own ``RLIMIT_NPROC`` count. Fallback, where unprivileged user namespaces are disabled (e.g.
  Ubuntu's AppArmor restriction): ``unshare`` runs as root and switches to 65534 itself
  (``--setuid``/``--setgid``, which also clears the groups).
* **No network**: a new network namespace has only a loopback interface, and it is down; every
  connection fails with "Network is unreachable", also to the host's 127.0.0.1.
* **Processes**: in the new pid namespace (with its own ``/proc``, so host processes are
  invisible) the launcher is pid 1, a minimal init: it forks the code, reaps orphans and exits
  with the code's status, and when pid 1 exits the kernel kills everything left in the namespace.
  On the wall-clock timeout the parent kills the process group (``os.killpg``, SIGKILL), which
  includes pid 1; ``--kill-child`` kills pid 1 as well if ``unshare`` dies first.
* **Limits**, hard (``setrlimit`` by the launcher in the forked child, just before it exec's
  ``python -I -S -u main.py``): CPU time ``cpu_s`` (SIGXCPU, SIGKILL a second later), address
  space ``memory_mb`` (``MemoryError``), processes and threads :data:`MAX_PROCESSES` (a fork bomb
  stops there), file size :data:`MAX_FILE_BYTES` (it also bounds the output file; Python ignores
  SIGXFSZ, so a write past it fails with "File too large"), open files :data:`MAX_OPEN_FILES`, no
  core dumps. The wall clock ``timeout_s`` is the parent's.
* **Environment**: only PATH, HOME (the temporary directory), LANG=C.UTF-8,
  PYTHONDONTWRITEBYTECODE and PYTHONIOENCODING; ``-I -S`` also ignores PYTHON* variables, the
  user's site directory and site-packages. The temporary directory is removed afterwards.
* **Output**: stdout and stderr go to one anonymous temporary file of the parent (``-u``: in the
  order written); the parent reads at most ``max_output_bytes + 1`` bytes of it, so a huge print
  costs neither memory nor more than :data:`MAX_FILE_BYTES` of disk.

Interpreter: ``sys.executable`` when uid 65534 can run it, else the system ``python3`` (first on
:data:`SANDBOX_PATH`), whose version may differ. A venv's python is often a link into a directory
65534 cannot enter (here ``/root/.pyenv``; ``/root`` has mode 700), and ``-S`` hides site-packages
anyway: the sandbox offers the standard library, not numpy.

:func:`detect_sandbox` (cached; the first :func:`run_python` calls it) runs a probe through each
isolation above and keeps the first one that runs as 65534 without network. When none works (not
root, no ``unshare``, namespaces forbidden as in a default Docker container) it raises
:class:`~posttrain.errors.ConfigError`: the tool refuses rather than run code unsandboxed.

Limits of this sandbox
----------------------
* Memory is limited per process, not in total: the worst case is MAX_PROCESSES x memory_mb
  (cgroups would give a total).
* The filesystem is the host's: the code can read world-readable files (this repository's source,
  for one) and write into world-writable directories (/tmp, /dev/shm), files of up to
  MAX_FILE_BYTES that are not cleaned up. A private /tmp would need a bind mount done as root.
* Without a user namespace (the fallback), RLIMIT_NPROC counts every process of uid 65534 on the
  host, so concurrent sandboxes share the MAX_PROCESSES budget.
* The kernel is shared: this stops accidents and ordinary escapes (files, network, processes,
  resources), not a kernel exploit; use a VM (gVisor, Firecracker) against that.
* An exit status of 128+N from the code is reported as a kill by signal N (like a shell).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from posttrain.errors import ConfigError

SANDBOX_UID = SANDBOX_GID = 65534
"""The unprivileged user ("nobody") that runs the code."""
MAX_PROCESSES = 16
"""RLIMIT_NPROC: processes and threads of the sandbox user (per sandbox with a user namespace)."""
MAX_FILE_BYTES = 16 * 2**20
"""RLIMIT_FSIZE: largest file the code may write, its output included."""
MAX_OPEN_FILES = 64
"""RLIMIT_NOFILE."""
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"

# Run by the sandbox's python as pid 1 of the new pid namespace, already as uid 65534.
# argv: cpu seconds, address-space bytes, processes, file bytes, open files.
_LAUNCHER = """\
import os, resource, sys, traceback
if os.getuid() == 0 or os.geteuid() == 0:
    sys.exit("sandbox launcher: refusing to run code as root")
cpu, memory, nproc, fsize, nofile = map(int, sys.argv[1:6])
child = os.fork()
if child == 0:
    try:
        for limit, soft, hard in (
            (resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, memory, memory),
            (resource.RLIMIT_NPROC, nproc, nproc), (resource.RLIMIT_FSIZE, fsize, fsize),
            (resource.RLIMIT_NOFILE, nofile, nofile), (resource.RLIMIT_CORE, 0, 0)):
            resource.setrlimit(limit, (soft, hard))
        os.execv(sys.executable, [sys.executable, "-I", "-S", "-u", "main.py"])
    except BaseException:
        traceback.print_exc()
    os._exit(127)
while True:  # reap orphans until the code itself exits; then the kernel kills the rest
    pid, status = os.wait()
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
        sys.exit(code if code >= 0 else 128 - code)
"""

_PROBE = """\
import errno, os, socket
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
    net = "connected"
except OSError as e:
    net = errno.errorcode.get(e.errno, str(e))
print(os.getuid(), os.getgid(), net)
"""
_PROBE_OK = f"{SANDBOX_UID} {SANDBOX_GID} ENETUNREACH"


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one :func:`run_python` call."""

    output: str
    """stdout and stderr, interleaved as written, truncated to ``max_output_bytes``."""
    exit_code: int | None
    """The code's exit status; -N if killed by signal N; None if it timed out."""
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
    """How this host runs the sandbox (found by :func:`detect_sandbox`)."""

    unshare: str
    python: str
    """The interpreter inside the sandbox (uid 65534 must be able to run it)."""
    user_namespace: bool
    """True: ``unshare`` runs as 65534 and creates a user namespace; False: it runs as root."""

    def command(self, limits: list[int]) -> list[str]:
        """The ``unshare`` command line that runs the launcher (which runs ``main.py``)."""
        flags = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
        if self.user_namespace:
            flags = ["--user", "--map-current-user", *flags]
        else:
            flags += [f"--setgid={SANDBOX_GID}", f"--setuid={SANDBOX_UID}"]
        return [self.unshare, *flags, self.python, "-I", "-S", "-c", _LAUNCHER, *map(str, limits)]

    def popen_user(self) -> dict[str, object]:
        """``Popen`` arguments that switch to the sandbox user before exec'ing ``unshare``."""
        if not self.user_namespace:
            return {}
        return {"user": SANDBOX_UID, "group": SANDBOX_GID, "extra_groups": []}


def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: float = 5.0, memory_mb: int = 512,
               max_output_bytes: int = 16384) -> SandboxResult:
    """Runs ``code`` in the sandbox and returns its output; never raises for what the code does.

    Raises :class:`ConfigError` if this host cannot sandbox (see :func:`detect_sandbox`).
    """
    return _run(code, detect_sandbox(), timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb,
                max_output_bytes=max_output_bytes)


_detected: SandboxSetup | ConfigError | None = None


def detect_sandbox() -> SandboxSetup:
    """The first isolation that works here, probed once and cached (so is a failure).

    Raises :class:`ConfigError` when there is none.
    """
    global _detected
    if _detected is None:
        try:
            _detected = _probe_setups()
        except ConfigError as e:
            _detected = e
    if isinstance(_detected, ConfigError):
        raise ConfigError(str(_detected))
    return _detected


def _probe_setups() -> SandboxSetup:
    why = ("the code interpreter runs model-written code as uid 65534 in new network and pid "
           "namespaces (Linux, `unshare` from util-linux, started as root) and will not run it "
           "unsandboxed")
    if not sys.platform.startswith("linux"):
        raise ConfigError(f"The code interpreter needs Linux namespaces: {why}.")
    if os.geteuid() != 0:
        raise ConfigError(f"The code interpreter must be started as root (to switch to uid 65534): {why}.")
    unshare = shutil.which("unshare") or shutil.which("unshare", path=SANDBOX_PATH)
    if unshare is None:
        raise ConfigError(f"The code interpreter needs the `unshare` command (util-linux): {why}.")
    pythons = [p for p in dict.fromkeys([sys.executable, shutil.which("python3", path=SANDBOX_PATH)]) if p]
    tried = []
    for python in pythons:
        for user_namespace in (True, False):
            setup = SandboxSetup(unshare, python, user_namespace)
            result = _run(_PROBE, setup, timeout_s=20, cpu_s=5, memory_mb=512, max_output_bytes=2000)
            if result.output.strip() == _PROBE_OK and result.error is None:
                return setup
            kind = "user namespace" if user_namespace else "root unshare"
            tried.append(f"{python} ({kind}): {result.text.strip()[-300:]!r}")
    raise ConfigError(f"The code interpreter needs Linux namespaces (unshare), but none of the ways "
                      f"to sandbox works here: {why}. Tried:\n" + "\n".join(tried))


def _run(code: str, setup: SandboxSetup, *, timeout_s: float, cpu_s: float, memory_mb: int,
         max_output_bytes: int) -> SandboxResult:
    cpu = max(1, math.ceil(cpu_s))
    file_bytes = max(MAX_FILE_BYTES, max_output_bytes + 1)
    limits = [cpu, memory_mb * 2**20, MAX_PROCESSES, file_bytes, MAX_OPEN_FILES]
    workdir = tempfile.mkdtemp(prefix="posttrain-sandbox-")
    env = {"PATH": SANDBOX_PATH, "HOME": workdir, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    try:
        os.chown(workdir, SANDBOX_UID, SANDBOX_GID)  # mode 700: only the sandbox user gets in
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(setup.command(limits), cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    **setup.popen_user())
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if proc.returncode is None:  # timeout, or an exception here (KeyboardInterrupt)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            size = os.fstat(out.fileno()).st_size
            out.seek(0)
            data = out.read(max_output_bytes + 1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    errors = []
    if size > max_output_bytes:
        data = data[:max_output_bytes]
        more = "at least " if size >= file_bytes else ""
        errors.append(f"output truncated to its first {max_output_bytes} bytes (of {more}{size})")
    exit_code = None if timed_out else _exit_code(proc.returncode)
    outcome = _describe(exit_code, timeout_s, cpu, memory_mb, file_bytes)
    if outcome:
        errors.append(outcome)
    return SandboxResult(output=data.decode("utf-8", errors="replace"), exit_code=exit_code,
                         timed_out=timed_out, error="; ".join(errors) or None)


def _exit_code(returncode: int) -> int:
    """The launcher exits with 128+N when the code was killed by signal N; returns -N for that."""
    if 128 < returncode < 128 + signal.NSIG:
        return 128 - returncode
    return returncode


def _describe(exit_code: int | None, timeout_s: float, cpu: int, memory_mb: int, file_bytes: int) -> str | None:
    if exit_code is None:
        return f"timed out after {timeout_s:g} s (wall clock); the process and its children were killed"
    if exit_code >= 0:
        return None if exit_code == 0 else f"exited with status {exit_code}"
    sig = -exit_code
    if sig == signal.SIGXCPU:
        return f"CPU-time limit of {cpu} s reached; killed"
    if sig == signal.SIGXFSZ:
        return f"file-size limit reached (the output or a file grew past {file_bytes} bytes); killed"
    if sig == signal.SIGKILL:
        return f"killed by SIGKILL (CPU-time limit of {cpu} s, or out of memory: limit {memory_mb} MB)"
    try:
        return f"killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"killed by signal {sig}"
