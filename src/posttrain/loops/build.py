"""``train(plan)``: build the run's session and run the loop that the plan's stage names
(:data:`posttrain.config.stages.STAGES`)."""

from __future__ import annotations

import importlib

from posttrain.config.plan import Plan
from posttrain.loops.session import Session


def build_trainer(plan: Plan, *, load_previous_on_corruption: bool = False):
    """The stage's loop on a new :class:`~posttrain.loops.session.Session` (which checks and
    locks the run's directories and the checkpoint it resumes from before any work)."""
    module, cls = plan.stage.loop.split(":")
    loop = getattr(importlib.import_module(module), cls)
    session = Session(plan, load_previous_on_corruption=load_previous_on_corruption)
    try:
        return loop(plan, session)
    except BaseException:
        session.close()
        raise


def train(plan: Plan, *, load_previous_on_corruption: bool = False) -> dict[str, float]:
    """Run the training job ``plan`` describes; returns the last iteration's metrics.

    ``load_previous_on_corruption`` (``posttrain train --load-previous-on-corruption``): when the
    checkpoint to resume from is corrupt, resume from the newest earlier complete one (a warning
    names both) instead of stopping with a :class:`~posttrain.errors.CheckpointError`."""
    return build_trainer(plan, load_previous_on_corruption=load_previous_on_corruption).fit()
