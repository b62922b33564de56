"""Run a test body on 2 spawned gloo ranks; the test fails with the first failing rank's traceback."""

from __future__ import annotations

import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def run_on_two_ranks(body, *args, out: Path) -> None:
    """``body(rank, *args)`` on ranks 0 and 1 of a gloo group (``body`` a module-level function)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(port, body, args, str(out)), nprocs=2, join=True)
    for rank in range(2):
        text = (out / f"rank{rank}").read_text()
        assert text == "ok", f"rank {rank}:\n{text}"


def _entry(rank: int, port: int, body, args: tuple, out: str) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        body(rank, *args)
        dist.destroy_process_group()
        Path(out, f"rank{rank}").write_text("ok")
    except BaseException:  # noqa: BLE001 - the parent reads it
        Path(out, f"rank{rank}").write_text(traceback.format_exc())
