"""Reading a Megatron checkpoint in full before a run loads it shard by shard."""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import CheckpointError
from posttrain.models.mcore import mcore_files
from posttrain.models.mcore.convert import McoreCheckpoint


def check_mcore_checkpoint(source: str | Path) -> bool:
    """Whether ``source`` is a Megatron checkpoint; if it is, check that it is complete and readable:
    a ``torch_dist`` one's metadata and common entries, or a legacy one's rank files (every rank's
    shard present, from one save; the critic's too). A :class:`CheckpointError` names a bad file."""
    if not mcore_files.is_mcore_checkpoint(source):
        return False
    it_dir = mcore_files.iteration_dir(Path(source))
    if mcore_files.is_dist_checkpoint(it_dir):
        from torch.distributed.checkpoint import FileSystemReader  # lazy: ~0.7 s (sympy); torch_dist checkpoints only

        for part in [it_dir] + [d for d in it_dir.iterdir() if mcore_files.is_dist_checkpoint(d)]:
            mcore_files.load_common(part)
            try:
                FileSystemReader(str(part)).read_metadata()
            except Exception as err:  # noqa: BLE001 - name the file whatever torch raises
                raise CheckpointError(f"{part / mcore_files.DIST_METADATA}: not readable ({err})") from None
        return True
    ckpt = McoreCheckpoint(source)
    for pp_rank in range(ckpt.par.pp):  # every rank file: intact (zip CRCs) and in its own slot
        for tp_rank in range(ckpt.par.tp):
            ckpt.rank(tp_rank, pp_rank)
        ckpt.release(pp_rank)
    for rank_file in sorted(ckpt.dir.glob(f"**/{mcore_files.RANK_FILE}")):
        if rank_file.parent.parent != ckpt.dir:  # a critic's, in a subdirectory
            mcore_files.load_rank_file(rank_file)
    return True
