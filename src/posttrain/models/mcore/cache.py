"""Megatron checkpoints given where posttrain loads a model: converted once into an HF cache.

``actor_config.load`` (and the reference, reward and critic loads) may name a Megatron checkpoint;
:func:`hf_cache_for` merges it into ``$POSTTRAIN_CACHE/mcore2hf/<key>/`` (default
``~/.cache/posttrain``) the first time and reuses it while the rank files are unchanged.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from posttrain.models.mcore import mcore_files
from posttrain.models.mcore.convert import mcore_to_hf

CACHE_ENV = "POSTTRAIN_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "posttrain") / "mcore2hf"


def hf_cache_for(mcore_dir: str | Path) -> Path:
    """The HF directory holding ``mcore_dir``'s weights, converting it on first use."""
    it_dir = mcore_files.iteration_dir(Path(mcore_dir))
    key = hashlib.sha256(str(it_dir.resolve()).encode())
    for f in sorted(it_dir.glob(f"mp_rank_*/{mcore_files.RANK_FILE}")):
        st = f.stat()
        key.update(f"{f.parent.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = cache_root() / key.hexdigest()[:20]
    if (out / "config.json").is_file():
        print(f"note: {mcore_dir} is a Megatron checkpoint; using its HF conversion cached in {out}", file=sys.stderr)
        return out
    args = mcore_files.read_args(it_dir)
    tokenizer = next((Path(p) for p in (getattr(args, "tokenizer_name_or_path", None),
                                        getattr(args, "tokenizer_model", None)) if p and Path(p).exists()), None)
    print(f"note: {mcore_dir} is a Megatron checkpoint; converting it once into {out} "
          f"(`posttrain convert --load-model-type mg --save-model-type hf` does the same)", file=sys.stderr)
    mcore_to_hf(it_dir, out, tokenizer=tokenizer, force=True, log=lambda msg: print(msg, file=sys.stderr))
    return out
