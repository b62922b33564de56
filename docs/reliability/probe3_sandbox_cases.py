"""The cases of docs/reliability/probe3_sandbox.md, runnable one by one (the tool-call and
tools-file cases are in probe3_sandbox_calls.py beside this file).

    PYTHONPATH=src python docs/reliability/probe3_sandbox_cases.py SB7      # one case
    PYTHONPATH=src python docs/reliability/probe3_sandbox_cases.py all      # every case
    PROBE_ISOLATION=root PYTHONPATH=src python ...                          # without a user namespace

Each case prints what it observed (the sandbox's answer, or what the host saw afterwards); the
verdicts are in the table. Sandbox cases need root (as the code interpreter does); every file a
case puts on the host is removed again.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from posttrain.tools.sandbox import run_python

CASES = {}


def case(fn):
    CASES[fn.__name__.split("_")[0]] = fn  # SB20b_the_code_kills_itself -> "SB20b"
    return fn


def show(result) -> str:
    text = result.text
    return text if len(text) < 1500 else text[:700] + f"\n...({len(text)} chars)...\n" + text[-700:]


def run(code: str, **kw) -> str:
    start = time.monotonic()
    result = run_python(code, **kw)
    return f"{show(result)}\n(exit {result.exit_code}, {time.monotonic() - start:.1f} s)"


def both(code_a: str, code_b: str, delay: float = 0.5) -> str:
    """Two calls at once, as the runner's workers make them."""
    out = {}
    a = threading.Thread(target=lambda: out.setdefault("A", run(code_a)))
    a.start()
    time.sleep(delay)
    out["B"] = run(code_b)
    a.join()
    return f"A: {out['A']}\nB: {out['B']}"


# ---------------------------------------------------------------- secrets and the environment
@case
def SB1_launcher_environ_and_fds():
    return run("import os\nfor p in ('/proc/1/environ', '/proc/1/cmdline', '/proc/1/fd'):\n"
               "    try:\n        print(p, (os.listdir(p) if p.endswith('fd') else open(p,'rb').read()[:200]))\n"
               "    except OSError as e:\n        print(p, type(e).__name__)")


@case
def SB2_parent_environment_secret():
    os.environ["POSTTRAIN_PROBE_SECRET"] = secret = "s3cr3t-" + uuid.uuid4().hex
    out = run("import os, glob\nblob = repr(dict(os.environ)).encode()\n"
              "for p in glob.glob('/proc/*/environ') + glob.glob('/proc/*/task/*/environ'):\n"
              "    try:\n        blob += open(p, 'rb').read()\n    except OSError:\n        pass\n"
              f"print('found' if b{secret!r} in blob else 'not found', sorted(os.environ))")
    del os.environ["POSTTRAIN_PROBE_SECRET"]
    return out


@case
def SB3_proc_self_views():
    return run("import os\nprint(open('/proc/self/status').read().split('Cap')[0][-300:])\n"
               "print(len(os.listdir('/proc')), sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
               "print(open('/proc/self/mountinfo').read()[:300])")


@case
def SB4_read_a_world_readable_secret():
    d = Path(tempfile.mkdtemp(prefix="probe-secret-", dir="/srv" if os.path.isdir("/srv") else None))
    try:
        os.chmod(d, 0o755)
        (d / "token").write_text("hf_visible")
        os.chmod(d / "token", 0o644)
        (d / "private").write_text("hf_private")
        os.chmod(d / "private", 0o600)
        return run(f"for n in ('token', 'private'):\n    try:\n        print(n, open('{d}/' + n).read())\n"
                   "    except OSError as e:\n        print(n, type(e).__name__)")
    finally:
        shutil.rmtree(d)


# ---------------------------------------------------------------- writing outside its directory
@case
def SB5_write_tmp_varTmp_devShm_persist():
    tag = uuid.uuid4().hex
    paths = [f"/tmp/probe-{tag}", f"/var/tmp/probe-{tag}", f"/dev/shm/probe-{tag}"]
    out = run(f"for p in {paths!r}:\n    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
              "    except OSError as e:\n        print(p, type(e).__name__)")
    left = [p for p in paths if os.path.exists(p)]
    for p in left:
        os.unlink(p)
    return f"{out}\nleft on the host: {left}"


@case
def SB6_world_writable_dir_outside_tmp():
    d = Path(tempfile.mkdtemp(prefix="probe-ww-", dir="/srv" if os.path.isdir("/srv") else "/var"))
    try:
        os.chmod(d, 0o1777)
        out = run(f"open('{d}/planted', 'w').write('x'); print('wrote')")
        return f"{out}\nplanted on the host: {(d / 'planted').exists()}"
    finally:
        shutil.rmtree(d)


@case
def SB7_repository_and_home():
    targets = [os.getcwd() + "/probe-planted", "/root/probe-planted", os.path.expanduser("~") + "/x"]
    out = run(f"import os\nprint(os.environ.get('HOME'), os.getcwd())\nfor p in {targets!r}:\n    try:\n"
              "        open(p, 'w'); print('wrote', p)\n    except OSError as e:\n        print(p, type(e).__name__)")
    for p in targets:
        if os.path.exists(p):
            os.unlink(p)
    return out


@case
def SB8_state_carries_between_calls():
    first = run("import os\nfor p in ('/tmp/carry', '/dev/shm/carry', os.path.expanduser('~/../carry')):\n"
                "    try:\n        open(p, 'w').write('from call 1')\n    except OSError as e:\n        print(p, e)")
    second = run("import os\nfor p in ('/tmp/carry', '/dev/shm/carry'):\n    try:\n"
                 "        print(p, open(p).read())\n    except OSError as e:\n        print(p, type(e).__name__)")
    for p in ("/tmp/carry", "/dev/shm/carry"):
        if os.path.exists(p):
            os.unlink(p)
    return f"call 1: {first}\ncall 2: {second}"


@case
def SB9_concurrent_calls_see_each_other():
    return both("import os, time\nopen('note.txt', 'w').write('mine')\nopen('/tmp/a-note', 'w').write('A')\n"
                "time.sleep(2.5)\nprint('A reads', open('note.txt').read())\nos.unlink('/tmp/a-note')",
                "import glob, os\nseen = glob.glob('/tmp/*') + glob.glob('/tmp/*/*')\n"
                "print([p for p in seen if 'note' in p or 'main.py' in p][:6])\n"
                "for p in glob.glob('/tmp/posttrain-sandbox-*/note.txt'):\n"
                "    try:\n        open(p, 'w').write('B was here'); print('overwrote', p)\n"
                "    except OSError as e:\n        print(type(e).__name__)")


@case
def SB10_sysv_shared_memory_between_calls():
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
            "shmid = libc.shmget(0x5eed, 4096, 0o1666)\nprint('shmid', shmid, os.strerror(ctypes.get_errno()))\n"
            "if shmid >= 0:\n    addr = libc.shmat(shmid, None, 0)\n    print('read', ctypes.string_at(addr, 12))\n"
            "    ctypes.memmove(addr, b'from call 1!', 12)")
    out = f"call 1: {run(code)}\ncall 2: {run(code)}"
    os.system("ipcrm -M 0x5eed 2>/dev/null")
    return out


@case
def SB11_unix_socket_under_run():
    path = f"/run/probe-{uuid.uuid4().hex[:8]}.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o666)
    server.listen()
    server.settimeout(0.1)
    try:
        out = run(f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect('{path}'); print('CONNECTED')\n"
                  "except OSError as e:\n    print(type(e).__name__, e)")
        try:
            server.accept()
            accepted = True
        except OSError:
            accepted = False
        return f"{out}\nthe host listener accepted: {accepted}"
    finally:
        server.close()
        os.unlink(path)


@case
def SB12_sys_shows_the_host_network():
    return run("import os\nprint(sorted(os.listdir('/sys/class/net')))\nprint(os.listdir('/sys/fs/cgroup')[:5])")


@case
def SB13_loopback_server_inside():
    return run("import socket\ntry:\n    s = socket.create_server(('127.0.0.1', 0)); p = s.getsockname()[1]\n"
               "    socket.create_connection(('127.0.0.1', p), timeout=1); print('loopback works')\n"
               "except OSError as e:\n    print(type(e).__name__, e)")


@case
def SB14_outside_network_and_dns():
    return run("import socket\nfor target in [('1.1.1.1', 53), ('example.com', 80)]:\n    try:\n"
               "        socket.create_connection(target, timeout=2); print('connected', target)\n"
               "    except OSError as e:\n        print(target, type(e).__name__, e)")


# ---------------------------------------------------------------- processes, signals, ptrace
@case
def SB15_nohup_daemon_after_timeout():
    marker = f"/tmp/probe-daemon-{uuid.uuid4().hex[:8]}"
    out = run(f"import os\nos.system('nohup sh -c \"while true; do date >> {marker}; sleep 0.3; done\" "
              ">/dev/null 2>&1 &')\nimport time; time.sleep(30)", timeout_s=2)
    time.sleep(1.5)
    size1 = os.path.getsize(marker) if os.path.exists(marker) else None
    time.sleep(1.0)
    size2 = os.path.getsize(marker) if os.path.exists(marker) else None
    if os.path.exists(marker):
        os.unlink(marker)
    return f"{out}\nhost marker size after the call: {size1} then {size2} (growing: a survivor)"


@case
def SB16_double_fork_setsid_daemon_main_exits():
    return run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        time.sleep(3); print('daemon still alive'); os._exit(0)\n    os._exit(0)\n"
               "print(os.readlink('/proc/self/ns/pid'))", timeout_s=5)


@case
def SB17_kill_minus_one():
    return run("import os, signal, subprocess\nsubprocess.Popen(['sleep', '50'])\nprint('before', flush=True)\n"
               "os.kill(-1, signal.SIGKILL)\nprint('survived')")


@case
def SB18_signal_the_parent_and_pid_1():
    return run("import os, signal\nprint(os.getppid())\nfor sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP):\n"
               "    try:\n        os.kill(1, sig); print('sent', sig.name)\n    except OSError as e:\n"
               "        print(sig.name, type(e).__name__)\nimport time; time.sleep(0.3); print('still running')")


@case
def SB19_ptrace_attach_to_pid_1():
    return run("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nr = libc.ptrace(16, 1, 0, 0)\n"
               "print('attach', r, ctypes.get_errno())\nif r == 0:\n    libc.ptrace(17, 1, 0, 0)\n"
               "try:\n    open('/proc/1/mem', 'r+b'); print('pid 1 memory opened for writing')\n"
               "except OSError as e:\n    print('mem', type(e).__name__)")


@case
def SB20_exit_status_137_is_not_a_kill():
    return run("import sys\nprint('normal exit')\nsys.exit(137)")


@case
def SB20b_the_code_kills_itself():
    return run("import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")


@case
def SB21_stop_itself():
    return run("import os, signal\nprint('stopping', flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)", timeout_s=2)


@case
def SB51_the_parent_dies_mid_call():
    import subprocess
    marker = uuid.uuid4().hex
    parent = subprocess.Popen([sys.executable, "-c", "import os, threading, time\n"
                               "from posttrain.tools.sandbox import run_python\n"
                               f"threading.Thread(target=run_python, args=('import time  # {marker}\\ntime.sleep(600)',),"
                               " kwargs={'timeout_s': 900}, daemon=True).start()\ntime.sleep(3)\nos._exit(0)"])
    parent.wait()
    time.sleep(2)
    alive = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, marker)]
    workdirs = [d for d in Path("/tmp").glob("posttrain-sandbox-*") if marker in _read_text(d / "main.py")]
    for pid in alive:
        os.kill(int(pid), 9)
    for d in workdirs:
        shutil.rmtree(d, ignore_errors=True)
    return f"after the parent exited: {len(alive)} sandbox processes still alive, {len(workdirs)} work dirs left in /tmp"


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _cmdline_has(pid: str, marker: str) -> bool:
    """Whether the process runs the probe's code (its main.py, or the launcher reading it)."""
    cwd = f"/proc/{pid}/cwd"
    return marker in _read_text(Path(cwd, "main.py")) or marker in _read_text(Path(f"/proc/{pid}/root/tmp/main.py"))


# ---------------------------------------------------------------- resources
@case
def SB22_memory_across_children():
    return run("import os, select, time\nr, w = os.pipe()\nfor i in range(4):\n    if os.fork() == 0:\n"
               "        b = bytearray(200 * 2**20)\n        for j in range(0, len(b), 4096): b[j] = 1\n"
               "        os.write(w, b'x'); time.sleep(30); os._exit(0)\nos.close(w)\ndone = b''\n"
               "while len(done) < 4 and select.select([r], [], [], 15)[0]:\n    got = os.read(r, 4)\n"
               "    if not got: break\n    done += got\n"
               "print(len(done), 'of 4 children hold 200 MB each at once')\nos._exit(0)", memory_mb=512, timeout_s=30)


@case
def SB23_ram_filled_through_dev_shm():
    out = run("import glob, os\nn = 0\ntry:\n    for i in range(40):\n"
              "        open(f'/dev/shm/fill{i}', 'wb').write(b'x' * 8 * 2**20); n += 1\n"
              "except OSError as e:\n    print(type(e).__name__, e)\nprint(n * 8, 'MB in /dev/shm')")
    left = [p for p in Path("/dev/shm").glob("fill*")]
    for p in left:
        p.unlink()
    return f"{out}\nleft on the host: {len(left)} files"


@case
def SB24_fill_the_temp_dir_disk():
    return run("import os\nn = 0\ntry:\n    for i in range(40):\n"
               "        open(f'big{i}', 'wb').write(b'x' * 8 * 2**20); n += 1\n"
               "except OSError as e:\n    print(type(e).__name__, e)\nprint(n * 8, 'MB written in', os.getcwd())")


@case
def SB25_cpu_across_children():
    return run("import os, time\nfor i in range(3):\n    if os.fork() == 0:\n"
               "        while time.process_time() < 1.5: pass\n        os._exit(0)\n"
               "for i in range(3): os.wait()\nt = os.times()\n"
               "print('the children used', round(t.children_user + t.children_system, 1), 's of CPU')",
               cpu_s=2, timeout_s=60)


@case
def SB26_fork_bomb_with_threads():
    return run("import threading, time\nn = 0\ntry:\n    while True:\n"
               "        threading.Thread(target=time.sleep, args=(3,), daemon=True).start(); n += 1\n"
               "except RuntimeError as e:\n    print(n, 'threads;', e)")


@case
def SB52_a_fork_bomb_starves_a_concurrent_call():
    return both("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                "            time.sleep(4); os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                "    print('A stopped at', n, 'children:', e.strerror)\ntime.sleep(3)",
                "import os\nkids = 0\ntry:\n    for i in range(4):\n        if os.fork() == 0:\n"
                "            os._exit(0)\n        kids += 1\nexcept OSError as e:\n    print('B could not fork:', e.strerror)\n"
                "print('B started', kids, 'children')", delay=1.5)


@case
def SB53_inherited_file_descriptors():
    return run("import os\nfds = sorted(int(f) for f in os.listdir('/proc/self/fd'))\n"
               "print([(fd, os.readlink(f'/proc/self/fd/{fd}')) for fd in fds if os.path.exists(f'/proc/self/fd/{fd}')])")


@case
def SB27_multiprocessing_pool_still_works():
    return run("import multiprocessing as mp\nif __name__ == '__main__':\n"
               "    with mp.Pool(2) as p:\n        print(p.map(abs, [-1, -2, -3]))")


# ---------------------------------------------------------------- output, input, code
@case
def SB28_non_utf8_and_nul_output():
    return run("import sys\nsys.stdout.buffer.write(b'ok \\xc3 \\x00 \\xff\\xfe end\\n')\n"
               "sys.stderr.buffer.write(b'err \\xe2\\x82\\n')")


@case
def SB29_one_gigabyte_of_output():
    return run("import sys\nchunk = b'z' * 2**20\nfor i in range(1024):\n    sys.stdout.buffer.write(chunk)")


@case
def SB30_stdin_reads():
    return run("import sys, os\nprint(repr(sys.stdin.read()), os.read(0, 100))\ninput()")


@case
def SB31_very_long_code():
    code = "x = 0\n" + "x += 1\n" * 3_000_000 + "print(x)"
    return f"{len(code) / 2**20:.1f} MiB of code: " + run(code, timeout_s=20)


@case
def SB32_nul_bytes_in_the_code():
    return run("print('a')\x00\nprint('b')")


@case
def SB33_keyring_shared_between_calls():
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nsys_ = libc.syscall\n"
            "kid = sys_(250, 10, -4, b'user', b'probe', 0)\nbuf = ctypes.create_string_buffer(64)\n"
            "print('found', sys_(250, 11, kid, buf, 64) > 0 and buf.value if kid > 0 else None)\n"
            "print('added' if sys_(248, b'user', b'probe', b'from call 1', 11, -4) > 0 else "
            "'add refused, errno %d' % ctypes.get_errno())")
    return f"call 1: {run(code)}\ncall 2: {run(code)}"


# ---------------------------------------------------------------- probe 2's cases
@case
def S9_write_into_pid_1():
    return run("print([l.strip() for l in open('/proc/1/limits') if 'address' in l or 'processes' in l or 'cpu time' in l])\n"
               "try:\n    f = open('/proc/1/mem', 'r+b', buffering=0)\n"
               "    m = [l for l in open('/proc/1/maps') if 'rw-p' in l][0]\n    a = int(m.split('-')[0], 16)\n"
               "    f.seek(a); b = f.read(16); f.seek(a); f.write(b); print('wrote pid 1 memory')\n"
               "except OSError as e:\n    print(type(e).__name__, e)")


@case
def S26_concurrent_calls_read_and_overwrite():
    return both("import time\nopen('note.txt', 'w').write('A wrote this')\ntime.sleep(2.5)\n"
                "print('A reads its own note:', open('note.txt').read())",
                "import glob\nfor d in glob.glob('/tmp/posttrain-sandbox-*'):\n    try:\n"
                "        print('B read', open(d + '/main.py').read()[:30]); open(d + '/note.txt', 'w').write('B overwrote this')\n"
                "    except OSError as e:\n        print(type(e).__name__)\nprint('B done')")


@case
def S5u_unix_socket_on_the_host_filesystem():
    d = Path(tempfile.mkdtemp(prefix="probe-usock-", dir="/srv" if os.path.isdir("/srv") else "/var"))
    os.chmod(d, 0o755)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(d / "s"))
    os.chmod(d / "s", 0o777)
    server.listen()
    try:
        return run(f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect('{d}/s'); print('UNIX CONNECTED')\n"
                   "except OSError as e:\n    print(type(e).__name__, e)")
    finally:
        server.close()
        shutil.rmtree(d)


def main(argv: list[str]) -> None:
    """``PROBE_ISOLATION=root`` runs the sandbox without a user namespace (the hosts that forbid them)."""
    if os.environ.get("PROBE_ISOLATION") == "root":
        import dataclasses

        from posttrain.tools import sandbox
        sandbox._detected = dataclasses.replace(sandbox.detect_sandbox(), user_namespace=False)
    sys.path.insert(0, str(Path(__file__).parent))
    from probe3_sandbox_calls import CASES as CALL_CASES  # the tool-call and tools-file cases

    CASES.update(CALL_CASES)
    names = list(CASES) if argv[1:] in (["all"], []) else argv[1:]
    for name in names:
        print(f"=== {name}", flush=True)
        print(CASES[name](), flush=True)


if __name__ == "__main__":
    main(sys.argv)
