"""Ray nodes as separate processes on this machine (``ray start``), for the multi-node tests.

Each node is one ``ray start`` run in a session of its own (``setsid``): the daemons it leaves
behind (the head's GCS, every node's raylet, agents and log monitor) keep that process group, and
the worker processes a raylet spawns (each in a group of its own) are its children. So the
processes of a node are exactly: the members of its group and their descendants. :meth:`RayNode.stop`
kills those, by pid. ``ray stop`` is never used: it kills every Ray process on the machine,
other sessions' too.

Every node gets its own temporary directory and its own ports (GCS, node manager, object
manager, agents, metrics, worker ports), so these clusters run beside other local Ray clusters.
Ray >= 2.5x turns on token authentication when a token exists (``~/.ray/auth_token``, which any
local ``ray.init`` writes); :class:`RayNodes` makes sure one exists and runs every process of its
cluster, the driver included, with ``RAY_AUTH_MODE=token``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv running the tests: its ray and posttrain
RAY = str(BIN / "ray") if (BIN / "ray").is_file() else (shutil.which("ray") or "ray")
PORT_NAMES = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
              "runtime-env-agent-port", "metrics-export-port")
WORKER_PORTS = 40  # each node's own range of worker ports


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that are free now (held together while the kernel picks them)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_range(width: int, low: int = 30000, high: int = 60000, avoid=()) -> int:
    """The first port of ``width`` consecutive ports that are all free now and none of ``avoid``
    (ports drawn for the node's components, free too until ``ray start`` binds them)."""
    for start in range(low + (os.getpid() * 97) % (high - low - width), high - width, width):
        if any(start <= port < start + width for port in avoid):
            continue
        try:
            held = []
            for port in range(start, start + width):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind(("", port))
            return start
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {width} consecutive free ports between {low} and {high}")


def gcs_port(args: list[str]) -> tuple[int, list[str]]:
    """The ``--port`` of ``ray start`` options and the other options."""
    port = next(int(a.split("=", 1)[1]) for a in args if a.startswith("--port="))
    return port, [a for a in args if not a.startswith("--port=")]


def node_args(temp_dir: Path, *more_ports: str) -> list[str]:
    """``ray start`` options that keep a node apart from any other Ray on this machine: its own
    temporary directory, ports (``more_ports`` too: the head's) and worker-port range. Every port
    comes from one :func:`free_ports` call, so no two of them can be the same."""
    names = (*PORT_NAMES, *more_ports)
    ports = dict(zip(names, free_ports(len(names))))
    first = free_range(WORKER_PORTS, avoid=ports.values())
    return ([f"--temp-dir={temp_dir}", "--disable-usage-stats", "--object-store-memory=100000000",
             f"--min-worker-port={first}", f"--max-worker-port={first + WORKER_PORTS - 1}"]
            + [f"--{name}={port}" for name, port in ports.items()])


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process now."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def session_pids(pgid: int) -> set[int]:
    """The processes of process group ``pgid`` and all their descendants."""
    table = process_table()
    found = {pid for pid, (_, group) in table.items() if group == pgid}
    grew = True
    while grew:
        more = {pid for pid, (parent, _) in table.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found


def kill_session(pgid: int, wait_s: float = 30.0) -> None:
    """SIGKILL every process of ``session_pids(pgid)`` (by pid) and wait until they are gone."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = session_pids(pgid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(pids)} of Ray session {pgid} survive SIGKILL")
        time.sleep(0.2)


def ensure_token() -> None:
    """A Ray authentication token for this user (what a local ``ray.init`` writes anyway)."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    if not (Path.home() / ".ray" / "auth_token").is_file():
        subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True)


def node_env() -> dict[str, str]:
    """The environment of the ``ray start`` processes (their workers inherit it): token auth, the
    checkout importable (``tests.helpers`` holds the test verifiers), offline, one thread, workers at
    nice 0 (at Ray's default 15 they starve on a loaded machine)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_worker_niceness": "0", "PYTHONPATH": path,
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@dataclass
class RayNode:
    """One ``ray start`` and what it left running (process group ``pgid``)."""

    name: str
    pgid: int
    temp_dir: Path
    node_id: str = ""
    stopped: bool = False

    def raylet_pid(self) -> int:
        for pid in session_pids(self.pgid):
            try:
                exe = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue
            if exe.endswith(b"/raylet"):
                return pid
        raise RuntimeError(f"Ray node {self.name}: no raylet among its processes")

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            kill_session(self.pgid)


@dataclass
class RayNodes:
    """A Ray cluster of nodes started one by one on this machine, 1 CPU each by default."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ptray")))  # short: socket paths
    port: int = 0  # the head's GCS port, drawn with the head's other ports
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, name: str, num_cpus: int = 1, timeout_s: float = 180.0) -> RayNode:
        """Start node ``name`` (the first one is the head) and wait until the cluster sees it alive."""
        head = not self.nodes
        temp = self.root / name
        temp.mkdir()
        head_ports = ("port", "dashboard-port", "ray-client-server-port") if head else ()
        args = [RAY, "start", f"--num-cpus={num_cpus}", *node_args(temp, *head_ports)]
        if head:
            self.port, _ = gcs_port(args)
            args += ["--head", "--include-dashboard=false"]
        else:
            args += [f"--address={self.address}"]
        log = temp / "ray_start.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, env=node_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            node = RayNode(name, proc.pid, temp)
            self.nodes.append(node)
            if proc.wait(timeout=timeout_s) != 0:
                raise RuntimeError(f"ray start for node {name} failed:\n{log.read_text()[-3000:]}")
        node.node_id = self.wait_alive(len([n for n in self.nodes if not n.stopped]), timeout_s)[-1]
        return node

    def wait_alive(self, count: int, timeout_s: float) -> list[str]:
        """The ids of the alive nodes once there are ``count``, newest last (a separate driver
        process asks: this test process must join the cluster only through posttrain)."""
        script = ("import json, sys, time, ray\n"
                  "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
                  "deadline = time.monotonic() + float(sys.argv[3])\n"
                  "while True:\n"
                  "    alive = [n for n in ray.nodes() if n['Alive']]\n"
                  "    if len(alive) >= int(sys.argv[2]) or time.monotonic() > deadline: break\n"
                  "    time.sleep(0.5)\n"
                  "print(json.dumps([n['NodeID'] for n in alive]))\n")
        out = subprocess.run([sys.executable, "-c", script, self.address, str(count), str(timeout_s)], env=node_env(),
                             check=False, capture_output=True, text=True, timeout=timeout_s + 120)
        if out.returncode != 0:
            raise RuntimeError(f"cannot ask the Ray cluster at {self.address} for its nodes:\n{out.stderr[-3000:]}")
        alive = json.loads(out.stdout.strip().splitlines()[-1])
        if len(alive) < count:
            raise RuntimeError(f"only {len(alive)} of {count} Ray nodes alive at {self.address} after {timeout_s} s")
        known = [n.node_id for n in self.nodes if n.node_id]
        return [n for n in alive if n in known] + [n for n in alive if n not in known]

    def close(self) -> None:
        for node in reversed(self.nodes):  # the head last
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)
