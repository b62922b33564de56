"""The sandbox's isolation, one test per case of the reliability probes that was not GOOD (probe 2's
S9, S26, S5u; probe 3's SB cases, docs/reliability/probe3_sandbox.md): pid 1 is out of the code's
reach and carries the limits, concurrent calls and consecutive calls share nothing, the host's
files are read-only, host sockets are unreachable, and memory and CPU are limited per call.

Each test runs under both isolations (``isolation`` in conftest.py) where it concerns them; all
need root, as the sandbox does.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from posttrain.tools import sandbox
from posttrain.tools.sandbox import run_python
from tests.helpers.sandbox import under_a_private_mount

REPO = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root")


def _ok(code: str, **kw) -> list[str]:
    result = run_python(code, **kw)
    assert result.error is None, result.text
    return result.output.splitlines()


@pytest.fixture
def host_dir():
    """A fresh directory of the host outside the sandbox's private mounts (in the repository, or in
    /var/lib for a checkout under /tmp: a path the sandbox's user may traverse), mode 0755, removed
    afterwards."""
    base = Path("/var/lib") if under_a_private_mount(REPO) else REPO
    path = base / f".sandbox-probe-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def test_pid_1_carries_the_limits_and_its_memory_is_out_of_reach(isolation):
    """Probe S9 (and SB19): the code could ptrace the sandbox's first process and write its memory,
    and that process had no limits (now it has all but CPU time, which it spends watching the code)."""
    lines = _ok("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "print('attach', libc.ptrace(16, 1, 0, 0))\n"
                "for path in ('/proc/1/mem', '/proc/1/environ'):\n"
                "    try:\n        open(path, 'rb')\n        print('opened', path)\n"
                "    except OSError as e:\n        print(type(e).__name__)\n"
                "print([l.split()[-3] for l in open('/proc/1/limits') if 'processes' in l or 'address space' in l])",
                memory_mb=300)
    cgroup = sandbox.detect_sandbox().cgroups
    processes = sandbox.SHARED_NPROC if isolation == "root" and cgroup and cgroup.limits_processes else 16
    assert lines == ["attach -1", "PermissionError", "PermissionError", f"['{processes}', '{300 * 2**20}']"]


def test_concurrent_calls_cannot_see_or_change_each_others_files(isolation):
    """Probe S26 (and SB9): B listed A's work dir, read A's code and overwrote A's note."""
    out = {}
    a = threading.Thread(target=lambda: out.setdefault("a", run_python(
        "import time\nopen('note.txt', 'w').write('A wrote this')\ntime.sleep(2)\n"
        "print(open('note.txt').read())", timeout_s=10)))
    a.start()
    b = run_python("import glob, time\ntime.sleep(0.5)\n"
                   "print(sorted(glob.glob('/tmp/**', recursive=True)))\n"
                   "for p in glob.glob('/tmp/posttrain-sandbox-*/note.txt') + glob.glob('/tmp/note.txt'):\n"
                   "    open(p, 'w').write('B overwrote this')", timeout_s=10)
    a.join()
    assert b.error is None and b.output.strip() == "['/tmp/', '/tmp/main.py']", b.text
    assert out["a"].text == "A wrote this\n"


@pytest.mark.parametrize("where", ["repository", "/run"])
def test_a_unix_socket_of_the_host_is_unreachable(isolation, host_dir, where):
    """Probe S5u (a socket in a host directory) and SB11 (one under /run): the code connected."""
    path = host_dir / "s" if where == "repository" else Path(f"/run/sandbox-probe-{uuid.uuid4().hex[:8]}.sock")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        os.chmod(path, 0o777)
        server.listen()
        [line] = _ok(f"import socket\ntry:\n    socket.socket(socket.AF_UNIX).connect({str(path)!r})\n"
                     "    print('connected')\nexcept OSError as e:\n    print(e.errno)")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()
        path.unlink(missing_ok=True)
    assert line == "97"  # EAFNOSUPPORT: the seccomp filter refuses socket(AF_UNIX)


def test_the_launcher_hides_its_environment_and_file_descriptors(isolation):
    """Probe SB1 (GOOD before: pid 1 held nothing secret then). A guard: pid 1 now holds the pipe
    that reports the code's exit status, so the code must not reach its file descriptors."""
    lines = _ok("import os\nfor p in ('/proc/1/environ', '/proc/1/fd'):\n    try:\n"
                "        os.listdir(p) if p.endswith('fd') else open(p, 'rb').read()\n        print('read', p)\n"
                "    except OSError as e:\n        print(type(e).__name__)")
    assert lines == ["PermissionError", "PermissionError"]


def test_files_in_tmp_var_tmp_and_dev_shm_stay_in_the_call(isolation):
    """Probes SB5 and SB8: files written to /tmp, /var/tmp and /dev/shm stayed on the host, and the
    next call read them."""
    name = f"sandbox-probe-{uuid.uuid4().hex[:8]}"
    paths = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}"]
    try:
        assert _ok(f"for p in {paths!r}:\n    open(p, 'w').write('call 1')\nprint('written')") == ["written"]
        left = [p for p in paths if os.path.exists(p)]
        second = _ok(f"import os\nprint([os.path.exists(p) for p in {paths!r}])")
    finally:
        for p in paths:
            Path(p).unlink(missing_ok=True)
    assert left == [] and second == ["[False, False, False]"]


def test_a_world_writable_directory_of_the_host_is_read_only(isolation, host_dir):
    """Probe SB6: the code planted a file in a world-writable host directory outside /tmp."""
    os.chmod(host_dir, 0o1777)
    assert _ok(f"try:\n    open('{host_dir}/planted', 'w')\nexcept OSError as e:\n    print(e.errno)") == ["30"]
    assert not (host_dir / "planted").exists()  # EROFS


def test_system_v_shared_memory_is_private_to_the_call(isolation):
    """Probe SB10: a SysV shared-memory segment outlived the call and the next call read it."""
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
            "addr = libc.shmat(libc.shmget(0x5eed, 4096, 0o1666), None, 0)\n"
            "print(ctypes.string_at(addr, 6))\nctypes.memmove(addr, b'call 1', 6)")
    try:
        assert _ok(code) == ["b'\\x00\\x00\\x00\\x00\\x00\\x00'"]
        assert _ok(code) == ["b'\\x00\\x00\\x00\\x00\\x00\\x00'"]
    finally:
        os.system("ipcrm -M 0x5eed >/dev/null 2>&1")


def test_sys_shows_only_the_sandboxs_own_network(isolation):
    """Probe SB12: /sys/class/net listed the host's network interfaces."""
    assert _ok("import os\nprint(sorted(os.listdir('/sys/class/net')), os.listdir('/sys/fs/cgroup'))") == ["['lo'] []"]


def test_signals_to_pid_1_do_not_end_the_call(isolation):
    """Probe SB18: SIGINT to pid 1 killed the launcher (a KeyboardInterrupt traceback) and the call."""
    lines = _ok("import os, signal, time\nfor sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):\n"
                "    try:\n        os.kill(1, sig)\n    except OSError:\n        pass\ntime.sleep(0.3)\nprint('alive')")
    assert lines == ["alive"]


def test_an_exit_status_of_137_is_not_reported_as_a_kill(isolation):
    """Probe SB20 (probe 2's S23, a documented limit then): sys.exit(137) was reported as "killed by
    SIGKILL (CPU-time limit ..., or out of memory ...)"."""
    result = run_python("import sys\nsys.exit(137)")
    assert (result.exit_code, result.error) == (137, "exited with status 137")


def test_the_code_killing_itself_is_not_blamed_on_a_limit(isolation):
    """Probe SB20b: a SIGKILL the code sent itself was blamed on the CPU or memory limit."""
    result = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.exit_code == -signal.SIGKILL
    assert result.error.startswith("killed by SIGKILL (not by a limit of the sandbox: by the code itself")


def test_memory_is_limited_over_all_of_a_calls_processes(isolation):
    """Probe SB22 (probe 2's S7b, a documented limit then): the children of one call held more than
    memory_mb together (4 x 200 MB under memory_mb=512); the limit was per process."""
    if sandbox.detect_sandbox().cgroups is None:
        pytest.skip("no cgroup for the calls on this host: memory is limited per process (as it says)")
    result = run_python("import os, select\nr, w = os.pipe()\nfor i in range(3):\n    if os.fork() == 0:\n"
                        "        b = bytearray(100 * 2**20)\n        for j in range(0, len(b), 4096): b[j] = 1\n"
                        "        os.write(w, b'x'); select.select([], [], [], 30); os._exit(0)\nos.close(w)\n"
                        "held = b''\nwhile len(held) < 3 and select.select([r], [], [], 6)[0]:\n"
                        "    held += os.read(r, 3)\nprint(len(held))\nos._exit(0)", memory_mb=160, timeout_s=60)
    assert int(result.output) < 3, result.text
    assert "the call went past its memory limit of 160 MB (all its processes together)" in result.error


def test_ram_and_disk_written_by_a_call_are_bounded_and_freed(isolation):
    """Probes SB23 and SB24: /dev/shm (the host's RAM) and the work directory (the host's disk)
    took every 8 MB file written, and /dev/shm kept them after the call."""
    name = f"sandbox-probe-{uuid.uuid4().hex[:8]}"
    lines = _ok(f"import errno\nfor d in ('/dev/shm', '/tmp'):\n    n = 0\n    try:\n        for i in range(20):\n"
                f"            open(f'{{d}}/{name}{{i}}', 'wb').write(b'x' * 8 * 2**20); n += 1\n"
                "    except OSError as e:\n        print(d, n * 8, errno.errorcode[e.errno])", timeout_s=30)
    left = list(Path("/dev/shm").glob(f"{name}*"))
    for path in left + list(Path("/tmp").glob(f"{name}*")):  # /tmp: the host's, without the fix
        path.unlink()
    assert [line.split()[::2] for line in lines] == [["/dev/shm", "ENOSPC"], ["/tmp", "ENOSPC"]]
    assert all(int(line.split()[1]) <= sandbox.TMPFS_BYTES // 2**20 for line in lines)
    assert left == []


def test_pid_1_has_no_cpu_limit_of_its_own(isolation):
    """A guard, not a probe case: pid 1 spends CPU watching the code for the whole wall clock (about
    1% here), so with RLIMIT_CPU it would die, and end the call, in a long idle call."""
    lines = _ok("print([l.split()[3:5] for l in open('/proc/1/limits') if 'cpu time' in l])\n"
                "print([l.split()[3:5] for l in open('/proc/self/limits') if 'cpu time' in l])", cpu_s=2)
    assert lines == ["[['unlimited', 'unlimited']]", "[['2', '3']]"]


def test_cpu_time_is_limited_over_all_of_a_calls_processes(isolation):
    """Probe SB25: three children used 1.5 s of CPU each under cpu_s=2 (the limit was per process)."""
    result = run_python("import os, time\nfor i in range(3):\n    if os.fork() == 0:\n"
                        "        while time.process_time() < 1.5: pass\n        os._exit(0)\n"
                        "for i in range(3): os.wait()\nprint('all done')", cpu_s=2, timeout_s=60)
    assert result.output == "" and result.exit_code == -signal.SIGKILL
    assert result.error.startswith("CPU-time limit of 2 s reached (all the call's processes together")


@pytest.mark.parametrize("code,message", [
    ("print(1)\n" * 150_000, "the code is 1,350,000 bytes long; the sandbox runs at most 1,048,576"),
    ("print('a')\x00\nprint('b')", "the code holds a NUL character (\\x00) at line 1, column 11"),
], ids=["long", "nul"])
def test_code_that_cannot_run_gets_a_message_that_says_why(code, message):
    """Probes SB31 (20 MiB of code: a MemoryError) and SB32 (a NUL byte: "invalid syntax" at a
    valid line)."""
    result = run_python(code)
    assert result.output == "" and result.error.startswith(message)


@pytest.mark.parametrize("isolation", ["root"], indirect=True)  # a user namespace has its own count
def test_a_fork_bomb_does_not_starve_a_concurrent_call(isolation):
    """Probe SB52: without a user namespace, a fork bomb in one call took uid 65534's whole process
    budget (RLIMIT_NPROC counts the uid over the host), and a concurrent call could not fork."""
    setup = sandbox.detect_sandbox()
    if not (setup.cgroups and setup.cgroups.limits_processes):
        pytest.skip("no user namespace and no pids cgroup: the process budget is shared (as the start-up line says)")
    out = {}
    bomb = threading.Thread(target=lambda: out.setdefault("a", run_python(
        "import os, time\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(4); os._exit(0)\n"
        "except OSError:\n    print('stopped', flush=True)\ntime.sleep(3)", timeout_s=20)))
    bomb.start()
    time.sleep(1.5)
    b = run_python("import os\nfor i in range(4):\n    if os.fork() == 0:\n        os._exit(0)\nprint('forked 4')")
    bomb.join()
    assert out["a"].output == "stopped\n" and b.text == "forked 4\n"


def test_the_kernel_keyrings_are_refused(isolation):
    """Probe SB33: without a user namespace, a key added by one call was read by the next."""
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.syscall(248, b'user', b'probe', b'secret', 6, -4), ctypes.get_errno())")
    assert _ok(code) == ["-1 38"]  # ENOSYS


def test_the_standard_librarys_process_pools_still_work(isolation):
    """Probe SB27 (GOOD before and after): multiprocessing needs /dev/shm and pipes, not Unix sockets."""
    assert _ok("import multiprocessing as mp\nif __name__ == '__main__':\n"
               "    with mp.Pool(2) as p:\n        print(p.map(abs, [-1, -2]))") == ["[1, 2]"]


def test_the_sandbox_says_what_it_isolates():
    """Deliverable 3 of issue 35: one line at start-up says what is isolated, and the memory limit in force."""
    line = sandbox.detect_sandbox().describe()
    assert "host files read-only; private /tmp, /var/tmp, /dev/shm and /run; no network" in line
    assert ("memory_mb over all of a call's processes (cgroup v" in line) != ("memory_mb per process only" in line)


def test_without_a_cgroup_the_message_says_memory_is_per_process():
    """Deliverable 3 of issue 35: never less isolation than the docs claim without saying so."""
    setup = sandbox.SandboxSetup("/usr/bin/python3", True, None, "cgroup v2 at /sys/fs/cgroup: Read-only file system")
    assert ("memory_mb per process only, not per call (no usable cgroup: cgroup v2 at /sys/fs/cgroup: "
            "Read-only file system)") in setup.describe()


def _runs(marker: str) -> list[int]:
    """Pids of the host whose sandbox runs code holding ``marker`` (seen through their own /tmp)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for path in (f"/proc/{pid}/cwd/main.py", f"/proc/{pid}/root/tmp/main.py"):
            if marker in _read(Path(path)):
                found.append(int(pid))
                break
    return found


def test_the_sandbox_dies_with_the_process_that_started_it(isolation):
    """Probe SB51: when the parent exited mid-call (a crashed trainer, an abandoned call at exit),
    the sandbox ran on to its own end (sleep(600): ten minutes) and its work dir stayed in /tmp."""
    marker = uuid.uuid4().hex
    parent = subprocess.Popen(
        [sys.executable, "-c", "import dataclasses, os, sys, threading\nfrom posttrain.tools import sandbox\n"
         f"sandbox._detected = dataclasses.replace(sandbox.detect_sandbox(), user_namespace={isolation == 'user-namespace'})\n"
         f"threading.Thread(target=sandbox.run_python, args=('import time  # {marker}\\ntime.sleep(600)',),"
         " kwargs={'timeout_s': 900}, daemon=True).start()\nsys.stdin.read()\nos._exit(0)"],
        stdin=subprocess.PIPE, env=os.environ)
    deadline = time.monotonic() + 30
    while not _runs(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    started = bool(_runs(marker))
    parent.stdin.close()  # the parent exits now, its call still running
    parent.wait(timeout=30)
    deadline = time.monotonic() + 5
    while _runs(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _runs(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    leftover_dirs = [d for d in Path("/tmp").glob("posttrain-sandbox-*") if marker in _read(d / "main.py")]
    for d in leftover_dirs:
        shutil.rmtree(d, ignore_errors=True)
    assert started and left == [] and leftover_dirs == []


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
