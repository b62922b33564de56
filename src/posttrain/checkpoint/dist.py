"""Checking a Megatron backend's checkpoint before its workers load it: the ``torch_dist`` format's
metadata, common entries and shards (every ``__*.distcp`` file its metadata names is present and
long enough for the bytes it indexes; the metadata and the objects pickled in the shards hold no
code, since torch and Megatron unpickle those with plain pickle), and a legacy one's rank files;
and the earlier complete iterations next to it, where ``--load-previous-on-corruption`` falls back.

A truncated shard would otherwise surface as an anonymous ``EOFError`` in one Ray worker, after
the workers were started. Bytes flipped inside a shard keep its size and are not detected here
(``dist_checkpointing`` keeps no checksums).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from posttrain.checkpoint.files import ITER_RE
from posttrain.checkpoint.verify import _load_file
from posttrain.errors import CheckpointError
from posttrain.models.mcore import mcore_files
from posttrain.models.mcore.checks import check_mcore_checkpoint


def _dist_parts(it_dir: Path) -> list[Path]:
    """The iteration dir and its model subdirectories (``critic/``) in the torch_dist format."""
    return [it_dir] + sorted(d for d in it_dir.iterdir() if d.is_dir() and mcore_files.is_dist_checkpoint(d))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``.metadata`` file (torch.distributed.checkpoint reads it with plain ``pickle``,
    which runs any code in it) allowing only its own classes, ``torch.Size`` and dtypes."""

    def find_class(self, module: str, name: str):
        import torch

        obj = super().find_class(module, name) if module.split(".")[0] in ("torch", "collections", "builtins",
                                                                          "pathlib") else None
        allowed = (module.startswith("torch.distributed.checkpoint.") and isinstance(obj, type)) or \
            (module == "torch" and (name == "Size" or isinstance(obj, torch.dtype))) or \
            (module, name) in {("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                               ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"),
                               ("pathlib", "PurePosixPath")}  # StorageMeta.checkpoint_id may be a path
        if not allowed:
            raise pickle.UnpicklingError(f"unsupported global {module}.{name}")
        return obj


def read_dist_metadata(part: Path):
    """The ``.metadata`` of the torch_dist checkpoint ``part``, unpickled safely (refusing code)."""
    metadata_file = part / mcore_files.DIST_METADATA
    try:
        with open(metadata_file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        if "unsupported global" in str(err):
            raise CheckpointError(f"{metadata_file}: refused: it holds pickled Python objects other than a "
                                  f"checkpoint's metadata ({err}), and unpickling them could run code") from None
        raise CheckpointError(f"{metadata_file}: not readable ({err}); the checkpoint is corrupt or "
                              f"truncated") from None
    except Exception as err:  # noqa: BLE001 - EOFError, ValueError...: a damaged file
        raise CheckpointError(f"{metadata_file}: not readable ({type(err).__name__}: {err}); the checkpoint is "
                              f"corrupt or truncated") from None


def check_pickled_items(part: Path, metadata) -> None:
    """The pickled objects inside the shards (Megatron's ``_extra_state`` and RNG states; the workers'
    ``dist_checkpointing.load`` unpickles them with ``weights_only=False``) read with
    ``weights_only=True``: pickled code is refused, naming the shard."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    objects = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in objects:
            continue
        shard = part / info.relative_path
        with open(shard, "rb") as f:
            f.seek(int(info.offset))
            blob = f.read(int(info.length))
        try:
            with torch.serialization.safe_globals(mcore_files.safe_globals()):
                torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - UnpicklingError, zip errors: name the shard
            first = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"{shard}: its entry {index.fqn} cannot be read safely ({type(err).__name__}: "
                                  f"{first}); the shard is corrupt, or holds pickled code (refused)") from None


def check_dist_shards(part: Path) -> None:
    """Every shard file the ``.metadata`` of ``part`` indexes exists and holds the indexed bytes, and
    the objects pickled in them are plain data."""
    metadata_file = part / mcore_files.DIST_METADATA
    metadata = read_dist_metadata(part)
    try:
        storage = metadata.storage_data
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
    check_pickled_items(part, metadata)


def verify_megatron_checkpoint(it_dir: str | Path) -> None:
    """Check the Megatron iteration dir ``it_dir`` in full before any worker loads it (see the
    module doc); :class:`CheckpointError` names the first bad file."""
    import torch  # lazy: plan imports checkpoint/

    it_dir = Path(it_dir)
    if mcore_files.is_dist_checkpoint(it_dir):
        for part in _dist_parts(it_dir):  # posttrain's own reads first: pickled code is refused, never run
            with torch.serialization.safe_globals(mcore_files.safe_globals()):
                _load_file(part / mcore_files.DIST_COMMON)
            check_dist_shards(part)
    check_mcore_checkpoint(it_dir)  # common.pt and .metadata readable; a legacy one's rank files


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
