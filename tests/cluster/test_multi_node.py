"""posttrain on a real two-node Ray cluster: a head and a second node, each a ``ray start`` of its
own with 1 CPU (the session fixture ``ray_nodes``, tests/helpers/ray_nodes.py), joined through
``rl_config.ray_address`` as a user joins a cluster.

With 1 CPU per node, posttrain's own placement group (one 1-CPU bundle per actor worker) must put
the 2 workers on different nodes; every test checks where they ran. On that cluster:

* GRPO on the HF backend (DDP, 2 workers) equals the run in one process: same responses, every
  logged metric but the wall-clock ones within 1e-5 relative (the invariance of test_ray_grpo.py,
  now across nodes);
* the Megatron backend at TP 2, its two ranks on two nodes, equals the same one-process run (as in
  test_ray_megatron.py) and resumes from its first checkpoint to the same second iteration;
* ``examples/cluster/master.sh`` and ``worker.sh`` bring a cluster up and the run joins it as
  docs/cluster.md says;
* losing the second node (its raylet SIGKILLed mid-iteration) stops the run with an error that
  names the worker and its node, and a restart on a fresh second node resumes from the last
  checkpoint to the uninterrupted run's result.

All runs: the tiny Qwen2 of test_ray_megatron.py, 4 prompts x 8 samples, 2 iterations.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.cluster_helpers import grpo_config, record_run
from tests.cluster.test_ray_grpo import is_wall_clock, same
from tests.cluster.test_ray_megatron import RL, TRAIN, model  # noqa: F401 (a fixture)
from tests.helpers.configs import run_dict
from tests.helpers.ray_nodes import BIN, ROOT, gcs_port, kill_session, node_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TIMEOUT_S = 120  # rl_config.ray_timeout_s: every wait of these runs ends within it


def config(work, name: str, model, *, workers: int, address: str | None = None, train: dict | None = None):
    rl = {**RL, "ray_timeout_s": TIMEOUT_S, **({"ray_address": address} if address else {})}
    return grpo_config(work, name, workers=workers, iters=2, rl=rl,
                       train={**TRAIN, "tokenizer_name_or_path": str(model), **(train or {})})


def iterations(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "actor/pg_loss" in r]


def assert_same_run(got: list[dict], want: list[dict], rel: float | None = None, skip=()) -> None:
    """Every logged metric but the wall-clock ones: within 1e-5 (``same``), or ``rel``."""
    got, want = iterations(got), iterations(want)
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want] and got
    for g, w in zip(got, want):
        assert sorted(k for k in g if k not in skip) == sorted(w)
        for key in (k for k in w if not is_wall_clock(k)):
            ok = g[key] == pytest.approx(w[key], rel=rel, abs=1e-6) if rel else same(g[key], w[key], key)
            assert ok, (w["iteration"], key, g[key], w[key])


def assert_spread(session, ray_nodes) -> None:
    """The run's 2 workers ran on the cluster's 2 alive nodes, one each (their own report)."""
    nodes = [info["node"] for info in session.cluster.info]
    alive = {n.node_id for n in ray_nodes.nodes if not n.stopped}
    assert len(nodes) == 2 and set(nodes) == alive, (nodes, alive)


@pytest.fixture(scope="module")
def one_process(work, model):
    """The reference: the run in one process, no Ray."""
    return record_run(config(work, "mn_local", model, workers=1))


@pytest.fixture(scope="module")
def two_nodes(ray_nodes, work, model):
    """The HF-backend run on 2 workers of the two-node cluster, saving after every iteration."""
    sessions = []
    run = record_run(config(work, "mn_hf", model, workers=2, address=ray_nodes.address,
                            train={"save": str(work / "mn_hf_ckpt"), "save_interval": 1}), sessions)
    return (*run, sessions[0])


def test_grpo_with_its_workers_on_two_nodes_equals_the_run_in_one_process(ray_nodes, two_nodes, one_process):
    batches, rows, _, session = two_nodes
    assert session.policy.model is None  # the driver joined the cluster; the weights live in the workers
    assert_spread(session, ray_nodes)
    assert batches == one_process[0] and len(batches) == 2 and batches[0] != batches[1]
    assert_same_run(rows, one_process[1])
    assert all(r["actor/grad_norm"] > 0 for r in iterations(rows)) and iterations(rows)[-1]["actor/kl_loss"] > 0


def test_megatron_tensor_parallel_across_two_nodes_trains_and_resumes(ray_nodes, work, model, one_process):
    """TP 2 with rank 0 on one node and rank 1 on the other (gloo over TCP between the nodes): the
    one-process run within 1e-4 (the tolerance of test_ray_megatron.py); resumed from the first
    iteration's Megatron checkpoint, the second iteration is the uninterrupted one exactly."""
    megatron = {"backend": "megatron", "tensor_model_parallel_size": 2, "save": str(work / "mn_mg_ckpt"),
                "save_interval": 1}
    sessions = []
    batches, rows, _ = record_run(config(work, "mn_mg", model, workers=2, address=ray_nodes.address,
                                         train=megatron), sessions)
    assert_spread(sessions[0], ray_nodes)
    assert batches == one_process[0]
    assert_same_run(rows, one_process[1], rel=1e-4, skip=("timing/resharding_to_infer",))
    assert (work / "mn_mg_ckpt" / "iter_0000001" / ".metadata").is_file()
    resumed = {**megatron, "load": str(work / "mn_mg_ckpt" / "iter_0000001"), "save": str(work / "mn_mg_resumed")}
    sessions = []
    again, resumed_rows, _ = record_run(config(work, "mn_mg_resumed", model, workers=2, address=ray_nodes.address,
                                               train=resumed), sessions)
    assert_spread(sessions[0], ray_nodes)
    assert again == batches[1:]
    (want,), (got,) = iterations(rows)[1:], iterations(resumed_rows)
    assert got["iteration"] == 2
    for key in (k for k in want if not is_wall_clock(k)):
        assert got[key] == want[key], key


def test_the_example_scripts_start_two_nodes_and_the_run_joins_them(work, model, one_process, tmp_path_factory):
    """``master.sh`` (head, wait for NNODES, train through RAY_ADDRESS) and ``worker.sh`` (join),
    with their own port, temp dirs and 1 CPU per node (DEVICES_PER_NODE=1) as the environment
    variables they document say; the run logs the one-process run's metrics, its workers on 2 nodes."""
    import tempfile

    if not all((BIN / tool).is_file() for tool in ("ray", "posttrain", "python")):
        pytest.skip(f"the scripts run $VENV/bin/{{ray,python,posttrain}}; {BIN} is not such a venv")
    configs = tmp_path_factory.mktemp("mn_script_configs")
    out = work / "run_mn_script"
    cfg = run_dict(model, work / "prompts/data", out, iters=2, rl_config={**RL, "ray_timeout_s": TIMEOUT_S},
                   megatron_training={**TRAIN, "tokenizer_name_or_path": str(model)},
                   generate_config={"dtype": "float32"})  # the suite's fp32 CPU (tests/conftest.py) is this process's
    (configs / "multinode.yaml").write_text(yaml.safe_dump(cfg))
    root = tempfile.mkdtemp(prefix="ptscr")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    ray_port, head_args = gcs_port(node_args(os.path.join(root, "head"), "port", "dashboard-port",
                                             "ray-client-server-port"))  # master.sh gives --port=$RAY_PORT
    env.update(VENV=str(BIN.parent), RAY_PORT=str(ray_port), NNODES="2", DEVICES_PER_NODE="1",
               WAIT_TIMEOUT_S="300", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", RAY_worker_niceness="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    log = work / "mn_master.log"
    started = []
    try:
        with open(log, "w") as master_log:
            master = subprocess.Popen(
                ["bash", str(ROOT / "examples/cluster/master.sh"), "multinode", "--config-path", str(configs),
                 "rl_config.actor_resource.num_npus=2"], cwd=ROOT, stdout=master_log, stderr=subprocess.STDOUT,
                env={**env, "RAY_START_ARGS": " ".join(head_args)}, start_new_session=True)
            started.append(master.pid)
            deadline = time.monotonic() + 300
            while "waiting for 2 node(s)" not in log.read_text():  # the head is up
                assert master.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1)
            with open(work / "mn_worker.log", "w") as worker_log:
                worker = subprocess.Popen(["bash", str(ROOT / "examples/cluster/worker.sh")], cwd=ROOT,
                                          stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**env, "MASTER_ADDR": "127.0.0.1",
                                               "RAY_START_ARGS": " ".join(node_args(os.path.join(root, "second")))})
                started.append(worker.pid)  # its session keeps the second node's daemons
                assert worker.wait(timeout=300) == 0, (work / "mn_worker.log").read_text()[-3000:]
            assert master.wait(timeout=900) == 0, log.read_text()[-5000:]
    finally:  # the head (left up by master.sh, as documented), the second node, the driver: by pid
        for pid in started:
            kill_session(pid)
        shutil.rmtree(root, ignore_errors=True)
    text = log.read_text()
    assert "2 / 2 nodes" in text
    placed = dict(re.findall(r"actor worker rank (\d) on node ([0-9a-f]{8})", text))
    assert sorted(placed) == ["0", "1"] and placed["0"] != placed["1"], text[-3000:]
    from tests.helpers.runs import read_metrics

    assert_same_run(read_metrics(out), one_process[1])


def gone(pid: int, timeout_s: float = 60.0) -> None:
    """Wait until process ``pid`` has exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if "zombie" in Path(f"/proc/{pid}/status").read_text():
                return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout_s} s after its raylet was killed"
        time.sleep(0.2)


def test_losing_the_second_node_mid_iteration_stops_the_run_and_a_restart_resumes(ray_nodes, work, model, two_nodes,
                                                                                   monkeypatch):
    """The second node's raylet SIGKILLed after the rollout of iteration 2 (as a lost machine): the
    run stops with a ClusterError naming the worker on that node and saying the node is dead (not a
    timeout, not the surviving rank's broken collective); the group is torn down. A fresh second
    node joins, and the run resumed from the last checkpoint (iteration 1) logs the uninterrupted
    run's iteration 2 (``two_nodes``) and draws its responses."""
    from posttrain.cluster import group
    from posttrain.cluster.remote import ClusterError
    from posttrain.commands.train import train_config as train

    second = ray_nodes.nodes[1]
    killed, original = {}, group.ActorRole.update

    def kill_then_update(self, *args, **kwargs):
        killed["calls"] = killed.get("calls", 0) + 1
        if killed["calls"] == 2:  # iteration 2, after its rollout, reward and advantages
            killed["rank"] = [i["node"] for i in self.c.info].index(second.node_id)
            killed["cluster"] = self.c
            os.kill(second.raylet_pid(), signal.SIGKILL)
            killed["at"] = time.monotonic()
            gone(self.c.info[killed["rank"]]["pid"])  # its workers follow their raylet within seconds
        return original(self, *args, **kwargs)

    monkeypatch.setattr(group.ActorRole, "update", kill_then_update)
    ckpt = work / "mn_killed_ckpt"
    cfg = config(work, "mn_killed", model, workers=2, address=ray_nodes.address,
                 train={"save": str(ckpt), "save_interval": 1})
    outcome = {}

    def run():
        try:
            train(cfg)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            outcome["error"] = err

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=2 * TIMEOUT_S + 120)  # a bound, in case anything hangs outside the timed waits
    assert not runner.is_alive(), "the run did not stop after its second node was lost"
    assert "at" in killed, "the second node was never killed"
    print(f"stopped {time.monotonic() - killed['at']:.1f} s after the raylet was killed: {outcome.get('error')}")
    err = outcome.get("error")
    assert isinstance(err, ClusterError), err
    message = str(err)
    rank = killed["rank"]
    assert message.startswith(f"actor update: actor worker rank {rank} on node {second.node_id[:8]}"), message
    assert "its node is dead" in message and "no answer" not in message, message
    assert killed["cluster"].closed
    assert (ckpt / "iter_0000001").is_dir() and not (ckpt / "iter_0000002").exists()
    monkeypatch.setattr(group.ActorRole, "update", original)

    second.stop()  # what is left of it
    ray_nodes.start("second_again")
    sessions = []
    batches, rows, _ = record_run(config(work, "mn_restarted", model, workers=2, address=ray_nodes.address,
                                         train={"load": str(ckpt), "save": str(work / "mn_restarted_ckpt"),
                                                "save_interval": 1}), sessions)
    assert_spread(sessions[0], ray_nodes)
    assert batches == two_nodes[0][1:]
    (want,), (got,) = iterations(two_nodes[1])[1:], iterations(rows)
    assert got["iteration"] == 2 and sorted(got) == sorted(want)
    for key in (k for k in want if not is_wall_clock(k)):
        assert got[key] == want[key], key  # the same processes' arithmetic: exactly
