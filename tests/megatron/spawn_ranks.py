"""Run a test body on spawned gloo ranks; the test fails with the first failing rank's traceback."""

from __future__ import annotations

import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def run_on_ranks(body, *args, out: Path, world: int = 2) -> None:
    """``body(rank, *args)`` on every rank of a gloo group of ``world`` processes (``body`` a
    module-level function)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(port, world, body, args, str(out)), nprocs=world, join=True)
    for rank in range(world):
        text = (out / f"rank{rank}").read_text()
        assert text == "ok", f"rank {rank}:\n{text}"


def _entry(rank: int, port: int, world: int, body, args: tuple, out: str) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        body(rank, *args)
        dist.destroy_process_group()
        Path(out, f"rank{rank}").write_text("ok")
    except BaseException:  # noqa: BLE001 - the parent reads it
        Path(out, f"rank{rank}").write_text(traceback.format_exc())
