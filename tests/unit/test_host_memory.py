"""posttrain.host_memory: freed memory reused inside a CPU run, glibc's behaviour otherwise.

Each case runs in a fresh process: glibc's state (its bins, its thresholds) is whatever the process
did before, and a test process has done a lot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from posttrain.host_memory import glibc

pytestmark = pytest.mark.skipif(glibc() is None, reason="glibc's mallopt (Linux)")

PAGES = 64 * 1024 * 1024 // 4096  # a 64 MiB block: over glibc's largest mmap threshold (32 MiB)

SCRIPT = """
import json, resource, sys, torch
from posttrain.host_memory import keep_freed_memory

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

faults = []
with keep_freed_memory(sys.argv[1]) as keeps:
    for _ in range(20):  # a step's buffer freed and allocated again, as a training loop does (glibc reuses
        # torch's 64-byte-aligned blocks once the heap holds a few free ones: after 7 to 9 here)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.empty(16 * 1024 * 1024).fill_(1.0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del block
    inside = rss_mib()
print(json.dumps({"keeps": keeps, "faults": faults, "rss_inside": inside, "rss_after": rss_mib()}))
"""


def run(device_type: str, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, device_type], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cpu_run_reuses_freed_pages_and_returns_them_when_it_ends():
    got = run("cpu")
    assert got["keeps"]
    assert sum(got["faults"][-4:]) < PAGES // 10, got  # the last steps reuse the freed blocks' pages
    assert got["rss_after"] < got["rss_inside"] - 48, got  # leaving returns the free blocks (malloc_trim)


@pytest.mark.parametrize("device_type, env", [("cuda", {}), ("cpu", {"POSTTRAIN_MALLOC": "default"})])
def test_other_devices_and_the_switch_keep_glibcs_behaviour(device_type, env):
    got = run(device_type, **env)
    assert not got["keeps"]
    assert min(got["faults"][-4:]) >= PAGES // 2, got  # every block mapped afresh and unmapped on free
