"""``posttrain train``: load and validate the config, then run the loop its ``stage`` names."""

from __future__ import annotations

import logging
from pathlib import Path

from posttrain.config.run import RunConfig, load_run_config
from posttrain.config.validate import validate_run_config
from posttrain.device import device_type


def run_dir_for(cfg: RunConfig) -> Path:
    """``rl_config.output_dir``, else ``runs/<config name>``."""
    return Path(cfg.rl.output_dir or Path("runs") / cfg.name)


def train(cfg: RunConfig) -> dict[str, float]:
    """Run the training job ``cfg`` describes; returns the last iteration's metrics."""
    layout = validate_run_config(cfg, device_type=device_type(cfg.rl.device))
    from posttrain.trainers.bundles import check_algorithm_config, get_bundle

    check_algorithm_config(cfg)
    run_dir = run_dir_for(cfg)
    if cfg.stage == "sft":
        from posttrain.trainers.offline import SFTTrainer

        return SFTTrainer(cfg, layout, run_dir).fit()
    if cfg.stage == "dpo":
        from posttrain.trainers.dpo import DPOTrainer

        return DPOTrainer(cfg, layout, run_dir).fit()
    from posttrain.trainers.onpolicy import OnPolicyTrainer
    from posttrain.trainers.session import Session

    bundle = get_bundle(cfg.stage)
    session = Session(cfg, layout, uses_reference=bundle.uses_reference(cfg.rl), run_dir=run_dir)
    try:
        return OnPolicyTrainer(cfg, layout, bundle, session).fit()
    finally:
        session.close()


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_run_config(args.config_name, args.config_path, args.overrides)
    train(cfg)
    return 0
