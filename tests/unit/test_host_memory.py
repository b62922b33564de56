"""posttrain.host_memory: freed memory reused inside a CPU run, glibc's behaviour outside it."""

from __future__ import annotations

import resource

import pytest
import torch

from posttrain.host_memory import glibc, keep_freed_memory

pytestmark = pytest.mark.skipif(glibc() is None, reason="glibc's mallopt (Linux)")

BIG = 16 * 1024 * 1024  # 64 MiB of float32: over glibc's largest mmap threshold (32 MiB)


def faults_of_a_reallocation() -> int:
    """Minor page faults of allocating and filling a 64 MiB tensor right after freeing one."""
    torch.empty(BIG).fill_(1.0)  # allocated and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(BIG).fill_(2.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_cpu_run_reuses_freed_pages_and_glibc_behaves_as_before_after_it():
    pages = BIG * 4 // 4096
    with keep_freed_memory("cpu") as keeps:
        assert keeps
        assert faults_of_a_reallocation() < pages // 10  # the freed block's pages, reused
    assert faults_of_a_reallocation() >= pages // 2  # mapped afresh and returned on free, as glibc does


def test_the_switch_and_other_devices_keep_glibcs_behaviour(monkeypatch):
    pages = BIG * 4 // 4096
    with keep_freed_memory("cuda") as keeps:
        assert not keeps
        assert faults_of_a_reallocation() >= pages // 2
    monkeypatch.setenv("POSTTRAIN_MALLOC", "default")
    with keep_freed_memory("cpu") as keeps:
        assert not keeps
        assert faults_of_a_reallocation() >= pages // 2
