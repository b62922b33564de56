"""``posttrain preprocess``: raw JSON/JSONL/Parquet/CSV/Arrow -> Megatron indexed dataset."""

from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

from posttrain.commands.outputs import check_writable_dir
from posttrain.config.loader import apply_overrides, normalise_keys, read_yaml, resolve_config_file
from posttrain.data.config import make_config
from posttrain.data.preprocess import preprocess
from posttrain.errors import ConfigError
from posttrain.rundir import DirLock


def existing_outputs(output_prefix: str) -> list[Path]:
    """The dataset files an earlier run wrote at ``output_prefix``: ``<prefix>_packed_*_document.{bin,idx}``."""
    prefix = Path(os.path.expanduser(output_prefix))
    pattern = glob.escape(str(prefix)) + "_packed_*_document.*"
    return sorted(Path(p) for p in glob.glob(pattern) if p.endswith((".bin", ".idx")))


def check_output_prefix(output_prefix: str, force: bool) -> None:
    """Before any work: refuse to replace an existing dataset at ``output_prefix`` without ``--force``."""
    found = existing_outputs(output_prefix)
    if found and not force:
        shown = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise ConfigError(f"output_prefix {output_prefix}: a dataset is already there ({shown} in "
                          f"{found[0].parent}); give another output_prefix, or --force to replace those files")


def load_config(config_name: str, config_path: str | None = None, overrides: list[str] | None = None):
    """``configs/datasets/NAME.yaml`` (or ``config_path``) with dotted ``key=value`` overrides, as a
    :class:`~posttrain.data.config.DataHandlerConfig`."""
    path = resolve_config_file(config_name, config_path, subdir="datasets")
    data = normalise_keys(read_yaml(path))
    data = apply_overrides(data, list(overrides or []))
    return make_config(data, source=str(path))


def run(args) -> int:
    cfg = load_config(args.config_name, args.config_path, args.overrides)
    if not cfg.output_prefix:
        summary = preprocess(cfg, strict=getattr(args, "strict", False))
    else:
        summary = _preprocess_locked(cfg, args)
    print(summary.format())
    return 0


def _preprocess_locked(cfg, args):
    """Preprocess into ``cfg.output_prefix`` holding a lock on its folder: one preprocess at a time
    per folder, since two runs at one prefix would publish a mix of both. The folder's writability
    is checked first (one block written); a folder this run created is removed again if it fails."""
    folder = Path(os.path.expanduser(cfg.output_prefix)).parent
    created = not folder.exists()
    check_writable_dir(folder, f"output_prefix {cfg.output_prefix}")
    lock = DirLock(folder, f"output_prefix {cfg.output_prefix}: its folder")
    try:
        check_output_prefix(cfg.output_prefix, bool(getattr(args, "force", False)))
        return preprocess(cfg, strict=getattr(args, "strict", False))
    except BaseException:
        if created:  # nothing of this run stays: its lock file, and the folder if nothing else is in it
            with contextlib.suppress(OSError):
                lock.path.unlink()
                folder.rmdir()
        raise
    finally:
        lock.release()
