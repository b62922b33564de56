"""The code-interpreter sandbox: it runs as uid 65534 without network, inside OS limits, in a
private /tmp with a stripped environment; it never raises for what the code does, and it refuses
(ConfigError) where it cannot sandbox. (The isolation cases of the third reliability probe are in
test_sandbox_isolation.py.)

The security tests run under both isolations (``isolation`` in conftest.py: a user namespace, and
namespaces created as root). The sandbox tests need root (as on CI); elsewhere they are skipped.
"""

import json
import os
import re
import resource
import shutil
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.tools import sandbox
from posttrain.tools.sandbox import SandboxResult, run_python
from tests.helpers.sandbox import under_a_private_mount

REPO = Path(__file__).resolve().parents[3]

needs_sandbox = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root")


def _timed(code: str, **kw) -> tuple[SandboxResult, float]:
    start = time.monotonic()
    result = run_python(code, **kw)
    return result, time.monotonic() - start


def _pid_namespace(output: str) -> str:
    match = re.search(r"pid:\[\d+\]", output)
    assert match, output[:500]
    return match.group(0)


def _live_processes_in(namespace: str, wait_s: float = 3.0) -> list[int]:
    """Pids of the non-zombie processes in a pid namespace, after waiting up to wait_s for none."""
    deadline = time.monotonic() + wait_s
    while True:
        live = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") != namespace:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:  # gone meanwhile
                continue
            if state != "Z":
                live.append(int(entry))
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.05)


def test_the_namespace_scan_finds_live_processes():
    assert os.getpid() in _live_processes_in(os.readlink("/proc/self/ns/pid"), wait_s=0)


@needs_sandbox
def test_print_returns_the_output():
    result = run_python("print(2**10)")
    assert result == SandboxResult(output="1024\n", exit_code=0, timed_out=False, error=None)
    assert result.text == "1024\n"


@needs_sandbox
def test_plain_python_and_its_standard_library_work():
    result = run_python("import itertools, math, fractions, json\n"
                        "print(math.comb(10, 3), sum(itertools.islice(itertools.count(), 5)),"
                        " fractions.Fraction(1, 3) * 3, json.dumps({'a': 1}))")
    assert result.text == '120 10 1 {"a": 1}\n'


@needs_sandbox
def test_an_exception_gives_its_traceback_and_a_nonzero_exit_code():
    result = run_python('print("before")\nraise ValueError("boom")')
    assert result.exit_code == 1 and not result.timed_out
    assert result.output.startswith("before\nTraceback (most recent call last):")  # in the order written
    assert "ValueError: boom" in result.output
    assert result.error == "exited with status 1"
    assert result.text.endswith("ValueError: boom\n[error: exited with status 1]")


@needs_sandbox
def test_a_busy_loop_is_stopped_by_the_cpu_limit():
    result, elapsed = _timed("while True: pass", cpu_s=1, timeout_s=20)
    assert elapsed < 8
    assert not result.timed_out and result.exit_code == -signal.SIGXCPU
    assert "CPU-time limit of 1 s" in result.text


@needs_sandbox
def test_the_wall_clock_timeout_kills_the_code_and_its_children():
    code = ("import os, time\nprint(os.readlink('/proc/self/ns/pid'))\n"
            "if os.fork() == 0:\n    os.setsid()  # leaves the process group\ntime.sleep(100)")
    result, elapsed = _timed(code, timeout_s=1)
    assert elapsed < 5
    assert result.timed_out and result.exit_code is None
    assert result.error.startswith("timed out after 1 s")
    assert _live_processes_in(_pid_namespace(result.output)) == []


def test_the_fork_bomb_stays_inside_its_limits_and_leaves_nothing(isolation):
    code = "import os\nprint(os.readlink('/proc/self/ns/pid'))\nwhile True:\n    os.fork()"
    result, elapsed = _timed(code, timeout_s=10, cpu_s=2)
    assert elapsed < 9
    assert result.error is not None
    assert "BlockingIOError" in result.output  # RLIMIT_NPROC stopped it, not the timeout
    assert _live_processes_in(_pid_namespace(result.output)) == []


def test_the_code_runs_unprivileged(isolation):
    code = ("import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())\n"
            "print([line for line in open('/proc/self/status') if line.startswith('CapEff')])\n"
            "print(os.system('id -u'))")
    result = run_python(code)
    assert result.error is None, result.text
    lines = result.output.splitlines()
    assert lines[0] == "65534 65534 65534 []"
    assert lines[1] == "['CapEff:\\t0000000000000000\\n']"
    assert lines[2:] == ["65534", "0"]  # os.system works, as the same user


def test_there_is_no_network(isolation):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        code = ("import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
                "except OSError as e:\n    print(type(e).__name__, e)")
        result = run_python(code)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert result.error is None, result.text
    assert result.output.startswith("OSError [Errno 101] Network is unreachable")


def test_the_workdir_is_a_private_tmp_and_the_parents_files_are_out_of_reach(isolation):
    name = f"sandbox_escape_probe_{uuid.uuid4().hex}.txt"
    probes = [Path(target, name) for target in sorted({str(REPO), os.getcwd()})]
    code = ("import os\nprint(os.getcwd())\nopen('mine.txt', 'w').write('ok')\n"
            f"for probe in {[str(p) for p in probes]!r}:\n"
            "    try:\n"
            "        open(probe, 'w')\n"
            "        print('wrote', probe)\n"
            "    except OSError as e:\n"
            "        print(type(e).__name__)")
    try:
        result = run_python(code)
        escaped = [p for p in probes if p.exists()]
    finally:
        for probe in probes:
            probe.unlink(missing_ok=True)
    assert result.error is None, result.text
    workdir, *attempts = result.output.splitlines()
    assert workdir == "/tmp" and not Path("/tmp/mine.txt").exists()
    # a read-only file system; a path under a private mount (a checkout in /tmp) is not there at all
    assert attempts == ["FileNotFoundError" if under_a_private_mount(p) else "OSError" for p in probes]
    assert escaped == []


@needs_sandbox
def test_the_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SANDBOX_SECRET", "hunter2")
    result = run_python("import json, os\nprint(json.dumps([os.getcwd(), dict(os.environ)]))")
    assert result.error is None, result.text
    workdir, env = json.loads(result.output)
    assert env == {"PATH": sandbox.SANDBOX_PATH, "HOME": workdir, "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    assert "hunter2" not in result.output


@needs_sandbox
def test_a_huge_print_is_truncated():
    result, elapsed = _timed('print("x" * 10**8)', max_output_bytes=1000)
    assert elapsed < 5
    assert result.output == "x" * 1000
    assert result.error.startswith("output truncated to its first 1000 bytes")
    assert result.text.startswith("x" * 1000 + "\n[error: output truncated")


@needs_sandbox
def test_printing_forever_stops_at_the_file_size_limit():
    result, elapsed = _timed('while True:\n    print("y" * 999)', max_output_bytes=5000)
    assert elapsed < 5 and not result.timed_out
    assert result.output == ("y" * 999 + "\n") * 5
    assert f"(of at least {sandbox.MAX_FILE_BYTES})" in result.error


@needs_sandbox
@pytest.mark.parametrize("code", ["a = bytearray(10**10)",
                                  "a = []\nwhile True:\n    a.append(bytearray(10**7))"])
def test_a_memory_bomb_gets_a_memory_error(code):
    result, elapsed = _timed(code, memory_mb=256)
    assert elapsed < 5
    assert result.exit_code == 1 and "MemoryError" in result.output
    assert result.error == "exited with status 1"


@needs_sandbox
def test_a_crash_is_reported_by_its_signal():
    result = run_python("import ctypes\nctypes.string_at(0)")
    assert result.exit_code == -signal.SIGSEGV
    assert result.error == "killed by SIGSEGV"


def test_it_refuses_to_run_unsandboxed(monkeypatch):
    monkeypatch.setattr(sandbox, "_detected", None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match="must be started as root.*will not run it unsandboxed"):
        run_python("print(1)")


def test_a_failing_probe_is_refused_once_and_cached(monkeypatch):
    calls = []

    def broken_run(code, setup, **kw):
        calls.append(setup)
        return SandboxResult(output="", exit_code=None, timed_out=False, error="the sandbox could not run the code: "
                             "creating the namespaces: [Errno 1] unshare: Operation not permitted"), None

    monkeypatch.setattr(sandbox, "_detected", None)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name, **kw: f"/usr/bin/{name}")
    monkeypatch.setattr(sandbox.cgroups, "find_cgroups", lambda: (None, "none in this test"))
    monkeypatch.setattr(sandbox, "_run", broken_run)
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"needs Linux namespaces(.|\n)*Operation not permitted"):
            run_python("print(1)")
    assert len(calls) == 2 * len({sys.executable, "/usr/bin/python3"})  # 2 isolations each, probed once


@needs_sandbox
def test_a_parent_holding_more_than_1024_files_can_still_run_code():
    """A guard: the status pipe's fd may be past select()'s FD_SETSIZE in a big process (a Ray worker)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("this process may not open 1200 files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert run_python("print(42)").text == "42\n"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
