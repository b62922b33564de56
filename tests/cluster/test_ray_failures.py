"""Failures on Ray: a killed worker, a worker that raises and one that hangs stop the driver with a
ClusterError that names the worker and says why, instead of a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.cluster.cluster_helpers import grpo_config

pytestmark = pytest.mark.ray


def test_a_worker_killed_mid_iteration_stops_the_run_with_a_clear_error(ray_cluster, work, monkeypatch):
    from posttrain.cluster import group
    from posttrain.cluster.remote import ClusterError
    from posttrain.commands.train import train_config as train

    killed = {}
    original = group.ActorRole.update

    def kill_then_update(self, *args, **kwargs):
        # after rollout, reward and advantages of iteration 2: SIGKILL rank 1, as an OOM killer would
        if not killed:
            pid = self.c.info[1]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed["pid"], killed["cluster"] = pid, self.c
        return original(self, *args, **kwargs)

    monkeypatch.setattr(group.ActorRole, "update", kill_then_update)
    cfg = grpo_config(work, "killed", workers=2, iters=3, rl={"ray_timeout_s": 300})
    with pytest.raises(ClusterError, match=r"actor update: actor worker rank 1 on node [0-9a-f]{8} \(.+\) died") as err:
        train(cfg)
    assert "no answer" not in str(err.value)  # the death was seen, not the timeout
    assert "its node is dead" not in str(err.value)  # only the worker died
    print(err.value)
    # the group was torn down: rank 0 (blocked in a collective with the dead rank) is gone too
    cluster = killed["cluster"]
    assert cluster.closed
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        ray_cluster.get(cluster.workers[0].ready_info.remote(), timeout=60)


def test_a_remote_error_carries_the_worker_traceback(ray_cluster):
    from posttrain.cluster.remote import ClusterError, gather

    @ray_cluster.remote(num_cpus=0)
    def broken():
        raise ValueError("the verifier module is missing")

    with pytest.raises(ClusterError, match="the verifier module is missing") as err:
        gather([broken.remote()], ["reward worker 0"], "rule reward", timeout_s=60)
    text = str(err.value)
    assert "rule reward failed on reward worker 0" in text and "in broken" in text  # the remote frames
    assert "\x1b[" not in text


def test_a_user_error_in_a_worker_is_its_message_without_the_worker_frames(ray_cluster):
    """Probe 3 (runs area, left open there): a full disk while a Ray worker of the hf backend saves
    (DDP or FSDP2: rank 0 writes) reached the user as the worker's traceback; a PosttrainError raised
    in a worker is now its one message, naming the worker."""
    from posttrain.cluster.remote import ClusterError, gather
    from posttrain.errors import CheckpointError

    @ray_cluster.remote(num_cpus=0)
    def full_disk():
        raise CheckpointError("runs/ckpt/iter_0000002: no space left on device; the previous checkpoint is intact")

    with pytest.raises(ClusterError) as err:
        gather([full_disk.remote()], ["actor worker rank 0"], "save checkpoint", timeout_s=60)
    assert str(err.value) == ("save checkpoint failed on actor worker rank 0: runs/ckpt/iter_0000002: no space left "
                              "on device; the previous checkpoint is intact")


def test_a_call_that_does_not_answer_times_out(ray_cluster):
    from posttrain.cluster.remote import ClusterError, gather

    @ray_cluster.remote(num_cpus=0)
    def stuck():
        time.sleep(60)

    ref = stuck.remote()
    with pytest.raises(ClusterError, match=r"no answer from actor worker rank 0 within rl_config.ray_timeout_s=1 s"):
        gather([ref], ["actor worker rank 0"], "actor update", timeout_s=1)
    ray_cluster.cancel(ref, force=True)


def test_the_cause_comes_before_a_collective_failing_with_it(ray_cluster, monkeypatch):
    """A peer's collective fails first (gloo: connection closed); the worker that raised the cause
    a moment later is reported first, with its traceback; a collective failure with no other raise
    names the workers that had not answered."""
    from posttrain.cluster import remote
    from posttrain.cluster.remote import ClusterError, gather

    monkeypatch.setattr(remote, "DEATH_GRACE_S", 2.0)  # how long the others get to show the cause

    @ray_cluster.remote(num_cpus=0)
    def collective_fails():
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4242")

    @ray_cluster.remote(num_cpus=0)
    def cause(seconds):
        time.sleep(seconds)
        raise ValueError("the loss is NaN at step 3")

    names = ["actor worker rank 0", "actor worker rank 1"]
    with pytest.raises(ClusterError) as err:
        gather([collective_fails.remote(), cause.remote(0.5)], names, "actor update", timeout_s=60)
    text = str(err.value)
    assert text.startswith("actor update failed on actor worker rank 1:\n") and "in cause" in text  # its frames
    assert "the loss is NaN at step 3" in text and text.rstrip().endswith(
        "(and actor worker rank 0 then failed: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed "
        "by peer [10.0.0.2]:4242)")
    slow = cause.remote(30)
    stuck = r"(?s)Connection closed by peer.*\(no answer yet from actor worker rank 1\)"
    with pytest.raises(ClusterError, match=stuck):
        gather([collective_fails.remote(), slow], names, "actor update", timeout_s=60)
    ray_cluster.cancel(slow, force=True)

    @ray_cluster.remote(num_cpus=0)
    def collective_times_out():
        raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 600000ms for recv")

    with pytest.raises(ClusterError, match=r"collectives wait rl_config.ray_timeout_s; raise it"):
        gather([collective_times_out.remote()], names[:1], "actor update", timeout_s=60)
