"""``posttrain train``: load the config and run the loop its ``stage`` names."""

from __future__ import annotations

import logging


def run(args) -> int:
    from posttrain.config.run import load_run_config
    from posttrain.trainers.stages import train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    train(load_run_config(args.config_name, args.config_path, args.overrides),
          load_previous_on_corruption=bool(getattr(args, "load_previous_on_corruption", False)))
    return 0
