"""``posttrain preprocess``: raw JSON/JSONL/Parquet/CSV/Arrow -> Megatron indexed dataset."""

from __future__ import annotations


def run(args) -> int:
    from posttrain.data.preprocess import load_config, preprocess

    cfg = load_config(args.config_name, args.config_path, args.overrides)
    summary = preprocess(cfg, strict=getattr(args, "strict", False))
    print(summary.format())
    return 0
