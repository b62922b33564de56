"""``posttrain train``: load the config, resolve its plan and run the loop its ``stage`` names."""

from __future__ import annotations

import logging

from posttrain.config.plan import Plan, resolve_plan
from posttrain.config.run import RunConfig, load_run_config
from posttrain.loops.build import train


def plan_named(config_name: str, config_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Plan:
    """The checked plan of ``configs/<config_name>.yaml`` (or ``config_path``) with ``key=value`` overrides."""
    return resolve_plan(load_run_config(config_name, config_path, list(overrides)))


def train_config(cfg: RunConfig, *, load_previous_on_corruption: bool = False) -> dict[str, float]:
    """Check ``cfg`` (and its files, as ``posttrain plan`` does), derive its plan and train it; returns
    the last iteration's metrics."""
    return train(resolve_plan(cfg, files=True), load_previous_on_corruption=load_previous_on_corruption)


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    train_config(load_run_config(args.config_name, args.config_path, args.overrides),
                 load_previous_on_corruption=bool(getattr(args, "load_previous_on_corruption", False)))
    return 0
