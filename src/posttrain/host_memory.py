"""Freed host memory kept in the process for a CPU run (glibc's ``mallopt``).

glibc hands every block over 32 MiB to the kernel on ``free`` (it maps it on its own), and gives the
top of its heap back once more than a threshold is free there. A training step frees and
reallocates the same large buffers every iteration: the LM head's ``[tokens, vocab]`` logits, the
gradients that ``zero_grad`` releases, the activations. Each reallocation then touches fresh pages,
which the kernel faults in and zeroes one 4 KiB page at a time: on issue 22's chat workload
(SmolLM2-135M, fp32, 2 threads) about 1.3 GB a step, 300,000 page faults, against the 1.2 million of
the whole run's first touch. :func:`keep_freed_memory` turns both off for the run (large blocks
come from the heap too, and the heap is not trimmed below 2 GiB free), so a step reuses the pages
of the step before; on leaving, glibc's defaults come back and the free memory is returned
(``malloc_trim``). The cost: the process holds the largest heap it has used, and its peak RSS grows
by what the heap fragments (about 10% on that workload; torch's 64-byte-aligned blocks are reused
only once the heap holds a few free ones: a loop that frees and reallocates one 64 MiB block settles
after 7 of them, 450 MiB over its first).

Only on Linux with glibc and a CPU device; ``POSTTRAIN_MALLOC=default`` keeps glibc's behaviour.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from collections.abc import Iterator

# mallopt's parameters (glibc's malloc.h) and glibc's defaults for them
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
DEFAULTS = {M_TRIM_THRESHOLD: 128 * 1024, M_TOP_PAD: 128 * 1024, M_MMAP_MAX: 65536}
KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 256 * 1024 * 1024}


def glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@contextlib.contextmanager
def keep_freed_memory(device_type: str) -> Iterator[bool]:
    """For the block: freed memory stays in this process for reuse (see the module). Yields whether
    it does (a CPU device, glibc, and ``POSTTRAIN_MALLOC`` not ``default``)."""
    libc = glibc() if device_type == "cpu" else None
    if libc is None or os.environ.get("POSTTRAIN_MALLOC", "").strip() == "default":
        yield False
        return
    for param, value in KEEP.items():
        libc.mallopt(param, value)
    try:
        yield True
    finally:
        for param, value in DEFAULTS.items():
            libc.mallopt(param, value)
        libc.malloc_trim(0)
