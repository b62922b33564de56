"""The sandbox's launcher: the program that builds one call's sandbox and runs the code in it.

:mod:`posttrain.tools.sandbox` runs this file's source as ``<python> -I -S -c <source> <config>``
(standard library only, Python >= 3.9, so the system ``python3`` can run it). Its stdin is the
code, its stdout and stderr the call's output file, and two pipes from the parent: ``go_fd`` (read
until the parent has put this process into the call's cgroup; -1 when there is none) and
``status_fd``, where it writes JSON lines: ``{"setup": ...}`` once the sandbox is built, then
``{"status": <wait status>, "cpu": <seconds>}`` when the code has ended (or ``{"error": ...}``).

Three processes::

    stage 0 (host pid; root, or uid 65534 with a user namespace)
      unshare(mount, net, pid, ipc, uts [, user]) -> fork
        init (pid 1 of the new pid namespace; all capabilities in its namespaces)
          private mounts, limits, then fork
            the code: capabilities dropped, uid 65534, no new privileges, seccomp -> exec python main.py

init keeps its capabilities and is not dumpable, so the code (without any) can neither ptrace it
nor open its memory or file descriptors; init ignores the signals the code could send it, and
carries the limits on memory, processes, file size and open files (not on CPU time: it watches
the code's for the whole call, and adds it up). When
init exits, the kernel kills whatever is left in the namespace; init dies with stage 0
(``PR_SET_PDEATHSIG``), and stage 0 with the thread of the parent that started it.
"""

import ctypes
import json
import os
import re
import resource
import signal
import socket
import struct
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 4096, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SYS_MOUNT_SETATTR, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, 0x8000, 1
IO_URING_SETUP = 425  # the same number on every architecture
# seccomp: per architecture, (AUDIT_ARCH, socket, add_key, request_key, keyctl)
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 41, 248, 249, 250), "aarch64": (0xC00000B7, 198, 217, 218, 219)}
IGNORED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGPIPE")

libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option, arg2=0):
    _check(libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)), f"prctl({option})")


def _mount(source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {fstype or '(remount)'} on {target}")


def _write(fd, record):
    os.write(fd, (json.dumps(record) + "\n").encode())


# ---------------------------------------------------------------- stage 0
def main(config):
    """Stage 0: wait for the cgroup, create the namespaces, fork init and pass on its exit."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != config["parent_pid"]:  # the parent died before the line above
        os._exit(1)
    status_fd = config["status_fd"]
    code = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if config["go_fd"] >= 0:
        go = os.read(config["go_fd"], 1)
        os.close(config["go_fd"])
        if go != b"g":
            os._exit(1)
    try:
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
        _check(libc.unshare(flags | (CLONE_NEWUSER if config["user_namespace"] else 0)), "unshare")
        if config["user_namespace"]:
            uid, gid = config["uid"], config["gid"]
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
        pid = os.fork()
    except OSError as e:
        _write(status_fd, {"error": f"creating the namespaces: {e}"})
        os._exit(1)
    if pid == 0:
        init(config, code)
    os.close(status_fd)
    _, status = os.waitpid(pid, 0)
    os._exit(0 if status == 0 else 1)


# ---------------------------------------------------------------- init (pid 1)
def init(config, code):
    status_fd = config["status_fd"]
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for name in IGNORED_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        applied = build_filesystem(config, code)
        socket.sethostname("sandbox")
        set_limits(config["limits"])
        _prctl(PR_SET_DUMPABLE, 0)
        child = os.fork()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which tells the user
        _write(status_fd, {"error": f"setting up the sandbox: {type(e).__name__}: {e}"})
        os._exit(1)
    if child == 0:
        run_code(config)
    _write(status_fd, {"setup": applied})
    watch(child, config["limits"]["cpu"], status_fd)


def watch(child, cpu_limit, status_fd):
    """Reap orphans until the code exits, then report and exit (the kernel kills what is left).
    Once all processes together have used ``cpu_limit`` CPU seconds, kill them all."""
    over = False
    while True:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == child:
            _write(status_fd, {"status": status, "cpu": cpu_seconds(), "cpu_limit_hit": over})
            os._exit(0)
        if pid:
            continue
        if not over and cpu_seconds() >= cpu_limit:
            over = True
            os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of the namespace
        time.sleep(0.05)


def cpu_seconds():
    """CPU time of the code and every process it started, alive or reaped (from this namespace's /proc)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                utime, stime, cutime, cstime = (int(x) for x in f.read().rsplit(")", 1)[1].split()[11:15])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        total += cutime + cstime if entry == "1" else utime + stime + cutime + cstime
    return total / os.sysconf("SC_CLK_TCK")


def build_filesystem(config, code):
    """Private mounts: the host's read-only, fresh /proc, /sys, /tmp, /var/tmp, /dev/shm, /run."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    readonly = make_readonly(config.get("readonly", "setattr"))
    size = config["tmpfs_bytes"]
    private = []
    for target, mode, nbytes in (("/tmp", "1777", size), ("/var/tmp", "1777", size),
                                 ("/dev/shm", "1777", size), ("/run", "755", 2**20)):
        if os.path.isdir(target) and not os.path.islink(target):
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"size={nbytes},mode={mode},nr_inodes=4096")
            private.append(target)
    try:
        _mount("sysfs", "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
        sys_view = "sysfs"
    except OSError:  # the host's /sys cannot be shown again here: hide it
        _mount("tmpfs", "/sys", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4096,mode=555")
        sys_view = "empty"
    uid, gid = config["uid"], config["gid"]
    with open("/tmp/main.py", "wb") as f:
        f.write(code)
    os.chown("/tmp/main.py", uid, gid)
    return {"readonly": readonly, "private": private, "sys": sys_view,
            "seccomp": os.uname().machine in SECCOMP_ARCHES}


def make_readonly(method):
    """Every mount of the host read-only in this namespace (mount_setattr, else one by one)."""
    if method == "setattr":
        attr = struct.pack("QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0)
        buf = ctypes.create_string_buffer(attr, len(attr))
        if libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_long(-100), b"/", ctypes.c_uint(AT_RECURSIVE),
                        buf, ctypes.c_size_t(len(attr))) == 0:
            return "mount_setattr"
        if ctypes.get_errno() not in (38, 22):  # ENOSYS, EINVAL: an older kernel; remount one by one
            _check(-1, "mount_setattr(/, read-only)")
    skipped = 0
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]
    for point in points:
        try:
            kept = os.statvfs(point).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME
                                               | MS_RELATIME)
            if not kept & (MS_NOATIME | MS_RELATIME):
                kept |= MS_STRICTATIME
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
        except OSError as e:
            if e.errno not in (2, 13):  # ENOENT, EACCES: out of reach, for the code as well
                raise
            skipped += 1
    return "remount" + (f" ({skipped} out of reach)" if skipped else "")


def set_limits(limits):
    """Every limit but CPU time, for pid 1 and (inherited) the code: pid 1 spends CPU watching the
    code for as long as the wall clock allows, so the code alone gets RLIMIT_CPU (:func:`run_code`)."""
    for name, value in (("RLIMIT_AS", limits["as"]), ("RLIMIT_NPROC", limits["nproc"]),
                        ("RLIMIT_FSIZE", limits["fsize"]), ("RLIMIT_NOFILE", limits["nofile"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


# ---------------------------------------------------------------- the code
def run_code(config):
    try:
        os.close(config["status_fd"])
        for name in IGNORED_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        drop_privileges(config["uid"], config["gid"], config["user_namespace"])
        cpu = config["limits"]["cpu"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        install_seccomp()
        os.chdir("/tmp")
        python = sys.executable
        os.execve(python, [python, "-I", "-S", "-u", "main.py"], config["env"])
    except BaseException as e:  # noqa: BLE001 - shown as the call's output
        os.write(2, f"sandbox: could not start the code: {type(e).__name__}: {e}\n".encode())
    os._exit(127)


def drop_privileges(uid, gid, user_namespace):
    """No capabilities (none regained by exec: empty bounding set) and uid/gid 65534, no groups."""
    cap = 0
    while libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), ctypes.c_ulong(0), ctypes.c_ulong(0),
                     ctypes.c_ulong(0)) == 0:
        cap += 1
    if cap < 32:
        _check(-1, f"dropping capability {cap}")
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    if not user_namespace:
        os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header = struct.pack("Ii", 0x20080522, 0)
    _check(libc.capset(ctypes.create_string_buffer(header, 8), ctypes.create_string_buffer(24)), "capset")
    with open("/proc/self/status") as f:
        held = [line.split()[0] for line in f if line.startswith("Cap") and int(line.split()[1], 16)]
    if held or os.getuid() != uid or os.getgid() != gid or os.getgroups():
        raise RuntimeError(f"privileges left after dropping them: {held} uid {os.getuid()}")


def install_seccomp():
    """Refuse socket(AF_UNIX) (host sockets are reachable by their path), io_uring (which could open
    one without socket()) and the kernel keyrings (kept per uid, so shared by calls); refuse every
    syscall of a foreign ABI (x32, 32-bit), whose numbers differ. Returns False on an architecture
    without a filter here."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCHES:
        return False
    arch, nr_socket, add_key, request_key, keyctl = SECCOMP_ARCHES[machine]
    allow, enosys, eafnosupport = 0x7FFF0000, 0x00050000 | 38, 0x00050000 | 97
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    prog = [  # (code, jump if true, jump if false, k); a jump skips that many instructions
        (ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, enosys),                  # 0-2: the architecture
        (ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, enosys),            # 3-5: the x32 ABI
        (jeq, 5, 0, add_key), (jeq, 4, 0, request_key), (jeq, 3, 0, keyctl),     # 6-8: keyrings -> 12
        (jeq, 2, 0, IO_URING_SETUP), (jeq, 2, 0, nr_socket), (ret, 0, 0, allow),  # 9-11; socket -> 13
        (ret, 0, 0, enosys),                                                     # 12
        (ld, 0, 0, 16), (jeq, 1, 0, socket.AF_UNIX), (ret, 0, 0, allow),         # 13-15: its domain
        (ret, 0, 0, eafnosupport),                                               # 16
    ]
    raw = b"".join(struct.pack("HBBI", code, jt, jf, k) for code, jt, jf, k in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf)), 16)
    _check(libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(2), fprog, ctypes.c_ulong(0), ctypes.c_ulong(0)),
           "installing the seccomp filter")
    return True


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
