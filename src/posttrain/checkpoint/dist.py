"""Checking a Megatron backend's checkpoint before its workers load it: the ``torch_dist`` format's
metadata, common entries and shards (every ``__*.distcp`` file its metadata names is present and
long enough for the bytes it indexes), and a legacy one's rank files; and the earlier complete
iterations next to it, where ``--load-previous-on-corruption`` falls back to.

A truncated shard would otherwise surface as an anonymous ``EOFError`` in one Ray worker, after
the workers were started. Bytes flipped inside a shard keep its size and are not detected here
(``dist_checkpointing`` keeps no checksums).
"""

from __future__ import annotations

import os
from pathlib import Path

from posttrain.checkpoint.files import ITER_RE
from posttrain.checkpoint.verify import _load_file
from posttrain.errors import CheckpointError
from posttrain.models.mcore import mcore_files
from posttrain.models.mcore.checks import check_mcore_checkpoint


def _dist_parts(it_dir: Path) -> list[Path]:
    """The iteration dir and its model subdirectories (``critic/``) in the torch_dist format."""
    return [it_dir] + sorted(d for d in it_dir.iterdir() if d.is_dir() and mcore_files.is_dist_checkpoint(d))


def check_dist_shards(part: Path) -> None:
    """Every shard file the ``.metadata`` of ``part`` indexes exists and holds the indexed bytes."""
    from torch.distributed.checkpoint import FileSystemReader  # lazy: ~0.7 s (sympy)

    metadata_file = part / mcore_files.DIST_METADATA
    try:
        storage = FileSystemReader(str(part)).read_metadata().storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception as err:  # noqa: BLE001 - name the file whatever torch raises
        raise CheckpointError(f"{metadata_file}: not readable ({type(err).__name__}: {err}); the checkpoint is "
                              f"corrupt or truncated") from None
    for name, size in sorted(needed.items()):
        shard = part / name
        try:
            have = os.stat(shard).st_size
        except OSError:
            raise CheckpointError(f"{shard} is missing: {metadata_file} indexes {size} bytes in it; the checkpoint "
                                  f"is incomplete (an interrupted copy?)") from None
        if have < size:
            raise CheckpointError(f"{shard}: {have} bytes, but {metadata_file} indexes {size}; the shard is "
                                  f"truncated (an interrupted copy, or a full disk)")


def verify_megatron_checkpoint(it_dir: str | Path) -> None:
    """Check the Megatron iteration dir ``it_dir`` in full before any worker loads it (see the
    module doc); :class:`CheckpointError` names the first bad file."""
    import torch  # lazy: plan imports checkpoint/

    it_dir = Path(it_dir)
    if mcore_files.is_dist_checkpoint(it_dir):
        for part in _dist_parts(it_dir):  # common.pt first, with posttrain's messages (pickled code refused)
            with torch.serialization.safe_globals(mcore_files.safe_globals()):
                _load_file(part / mcore_files.DIST_COMMON)
    check_mcore_checkpoint(it_dir)  # common.pt and .metadata readable; a legacy one's rank files
    if mcore_files.is_dist_checkpoint(it_dir):
        for part in _dist_parts(it_dir):
            check_dist_shards(part)


def megatron_iterations(save_dir: str | Path) -> list[tuple[int, Path]]:
    """The ``iter_*`` dirs of ``save_dir`` that hold a Megatron iteration, oldest first."""
    found = []
    for path in Path(save_dir).glob("iter_*"):
        m = ITER_RE.match(path.name)
        if m and path.is_dir() and mcore_files.is_mcore_checkpoint(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def earlier_megatron_iterations(it_dir: str | Path) -> list[Path]:
    """The Megatron iterations next to ``it_dir`` with a lower number, newest first (all of a save
    dir's iterations when ``it_dir`` is not an ``iter_*`` dir)."""
    it_dir = Path(it_dir)
    m = ITER_RE.match(it_dir.name)
    if m is None:
        return [p for _, p in reversed(megatron_iterations(it_dir))]
    return [p for it, p in reversed(megatron_iterations(it_dir.parent)) if it < int(m.group(1))]
