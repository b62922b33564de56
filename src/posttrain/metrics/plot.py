"""A PNG of chosen metrics against the iteration, read from a run's metrics.jsonl."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from posttrain.data.readers import read_jsonl
from posttrain.errors import PosttrainError


def plot_metrics(jsonl_path: str | Path, png_path: str | Path, keys: Sequence[str],
                 title: str | None = None) -> Path:
    """One panel per key (value vs iteration); written to a temporary file, then renamed.

    Keys absent from the file are left out; if none is present, raises PosttrainError.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib (~1 s) only to draw a plot
    from matplotlib.figure import Figure

    records = read_jsonl(jsonl_path, strict=False)  # a killed run may leave a truncated last line
    present = [k for k in keys if any(r.get(k) is not None for r in records)]
    if not present:
        raise PosttrainError(f"{jsonl_path}: none of the keys {list(keys)} has a value; "
                             f"check the key names against the file")
    fig = Figure(figsize=(6, 2.6 * len(present)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(present), 1, squeeze=False)[:, 0]
    for ax, key in zip(axes, present):
        pts = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("iteration")
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = png_path.with_name(f".{png_path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, png_path)
    return png_path
