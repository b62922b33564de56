"""Where the sandbox's per-call cgroups go (posttrain.tools.cgroups), on fake cgroup trees: cgroup v2
with the controllers enabled, v2 without them (the reason is said), v1, and none at all. The real
host's cgroups are exercised by test_sandbox_isolation.py."""

from __future__ import annotations

import pytest

from posttrain.tools import cgroups


def _v2_root(tmp_path, controllers="cpu memory pids", enabled="memory pids"):
    """A fake cgroup2 mount (the files the kernel would create in posttrain-sandbox/ included)."""
    (tmp_path / "cgroup.controllers").write_text(controllers + "\n")
    (tmp_path / "cgroup.subtree_control").write_text(enabled + "\n")
    (tmp_path / cgroups.BASE).mkdir()
    (tmp_path / cgroups.BASE / "cgroup.subtree_control").write_text("")
    return [(str(tmp_path), "cgroup2", "rw")]


def test_cgroup_v2_calls_go_under_posttrain_sandbox_with_both_limits(tmp_path):
    """Issue 35, deliverable 3: a memory limit for the whole call where cgroup v2 allows it."""
    host = cgroups._find_v2(_v2_root(tmp_path))
    base = tmp_path / cgroups.BASE
    assert host == cgroups.CgroupHost(2, {"memory": base}) and host.limits_processes
    assert (base / "cgroup.subtree_control").read_text() == "+memory +pids"
    call = cgroups.CallCgroup(host, "call-1-0", 256 * 2**20, 18)
    assert (base / "call-1-0" / "memory.max").read_text() == str(256 * 2**20)
    assert (base / "call-1-0" / "pids.max").read_text() == "18"
    call.attach(4242)
    assert (base / "call-1-0" / "cgroup.procs").read_text() == "4242"
    assert "cgroup v2 (memory and pids, under" in host.describe()


@pytest.mark.parametrize("controllers,enabled,why", [
    ("", "", "memory and pids are not v2 controllers here"),  # a hybrid host: v1 has them
    ("cpu memory pids", "cpu", "memory and pids are not enabled in its subtree_control"),
], ids=["hybrid", "not-enabled"])
def test_cgroup_v2_without_the_controllers_says_why(tmp_path, controllers, enabled, why):
    with pytest.raises(cgroups._Unusable, match=f"cgroup v2 at {tmp_path}: {why}"):
        cgroups._find_v2(_v2_root(tmp_path, controllers, enabled))


def test_cgroup_v1_calls_go_under_this_processs_own_cgroups(tmp_path):
    mounts = [(str(tmp_path / "memory"), "cgroup", "rw,memory"), (str(tmp_path / "pids"), "cgroup", "rw,pids")]
    (tmp_path / "memory" / "job").mkdir(parents=True)
    (tmp_path / "pids").mkdir()
    host = cgroups._find_v1(mounts, own={"memory": "/job", "pids": "/"})
    assert host.dirs == {"memory": tmp_path / "memory" / "job" / cgroups.BASE, "pids": tmp_path / "pids" / cgroups.BASE}
    cgroups.CallCgroup(host, "call-1-0", 2**62, 18)  # memory_mb: 2**30 is no limit
    assert (host.dirs["memory"] / "call-1-0" / "memory.limit_in_bytes").read_text() == "-1"
    assert (host.dirs["pids"] / "call-1-0" / "pids.max").read_text() == "18"


def test_no_cgroups_at_all_is_a_reason_not_an_error(monkeypatch):
    monkeypatch.setattr(cgroups, "_cgroup_mounts", lambda: [])
    assert cgroups.find_cgroups() == (None, "no cgroup v2 mount; no cgroup v1 memory hierarchy")
