"""A failed Megatron save (training/megatron/checkpoint.py) on 2 gloo ranks: when one rank cannot write
its part (a full disk; dist_checkpointing raises its CheckpointException, a BaseException), every
rank raises one CheckpointError saying the disk is full and which checkpoint is intact, the
temporary directory is removed and the tracker is unchanged; no rank waits forever at a barrier.
No model is built: the write itself is replaced."""

from __future__ import annotations

from pathlib import Path

from tests.megatron.spawn_ranks import run_on_ranks


def body(rank: int, save: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from posttrain.errors import CheckpointError
    from posttrain.training.megatron import checkpoint as ck

    def write(path, part, args, iteration, **kwargs):
        if iteration == 2 and dist.get_rank() == 1:
            full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
            raise CheckpointException("write", {1: (full, None)})
        (Path(path) / f"rank{dist.get_rank()}").write_text("ok")

    ck._write = write
    ck.save_megatron_checkpoint(save, 1, {"": ck.Part([], None, {})}, None)
    try:
        ck.save_megatron_checkpoint(save, 2, {"": ck.Part([], None, {})}, None)
    except CheckpointError as err:
        text = str(err)
    else:
        raise AssertionError("the failed save did not raise")
    assert "the disk is full" in text and "iter_0000001 is intact" in text, text
    dist.barrier()
    assert sorted(p.name for p in Path(save).iterdir()) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (Path(save) / "latest_checkpointed_iteration.txt").read_text() == "1\n"


def test_a_rank_that_cannot_write_fails_the_save_on_every_rank(tmp_path):
    """Probe RN33: the megatron backend's save on a full disk."""
    run_on_ranks(body, str(tmp_path / "save"), out=tmp_path)
