"""``train(cfg)``: resolve the config's plan, build the run's session, and run the loop that the
stage names (:data:`posttrain.config.stages.STAGES`)."""

from __future__ import annotations

import importlib
from pathlib import Path

from posttrain.config.plan import Plan, resolve_plan
from posttrain.config.run import RunConfig


def run_dir_for(cfg: RunConfig) -> Path:
    """``rl_config.output_dir``, else ``runs/<config name>``."""
    return Path(cfg.rl.output_dir or Path("runs") / cfg.name)


def build_trainer(cfg: RunConfig, plan: Plan, run_dir: Path, *, load_previous_on_corruption: bool = False):
    """The stage's loop on a new :class:`~posttrain.trainers.session.Session` (which checks and
    locks the run's directories and the checkpoint it resumes from before any work)."""
    from posttrain.trainers.session import Session

    module, cls = plan.stage.loop.split(":")
    loop = getattr(importlib.import_module(module), cls)
    session = Session(cfg, plan, run_dir, load_previous_on_corruption=load_previous_on_corruption)
    try:
        return loop(session.cfg, plan, session)
    except BaseException:
        session.close()
        raise


def train(cfg: RunConfig, *, load_previous_on_corruption: bool = False) -> dict[str, float]:
    """Run the training job ``cfg`` describes; returns the last iteration's metrics.

    ``load_previous_on_corruption`` (``posttrain train --load-previous-on-corruption``): when the
    checkpoint to resume from is corrupt, resume from the newest earlier complete one (a warning
    names both) instead of stopping with a :class:`~posttrain.errors.CheckpointError`."""
    plan = resolve_plan(cfg)
    return build_trainer(cfg, plan, run_dir_for(cfg), load_previous_on_corruption=load_previous_on_corruption).fit()
