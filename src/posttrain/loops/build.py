"""``train(plan)``: build the run's session and run the loop that the plan's stage names
(:data:`posttrain.config.stages.STAGES`), or with ``skip_train`` only the session's evaluation."""

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
        return loop(session.plan, session)  # the session's plan: with the tokenizer it built
    except BaseException:
        session.close()
        raise


def train(plan: Plan, *, load_previous_on_corruption: bool = False) -> dict[str, float]:
    """Run the training job ``plan`` describes; returns the last iteration's metrics.

    ``load_previous_on_corruption`` (``posttrain train --load-previous-on-corruption``): when the
    checkpoint to resume from is corrupt, resume from the newest earlier complete one (a warning
    names both) instead of stopping with a :class:`~posttrain.errors.CheckpointError`.

    ``megatron_training.skip_train`` (Megatron's ``--skip-train``: bypass the training loop, evaluate,
    exit): the session loads the model and evaluates it on ``rl_config.eval_data_path`` (``eval/*``
    in ``eval.jsonl`` and the metric sinks, at the loaded iteration), then closes: no iteration, no
    update, no checkpoint. Returns that evaluation's metrics."""
    if plan.schedule.skip_train:
        session = Session(plan, load_previous_on_corruption=load_previous_on_corruption)
        session.close()
        return session.start_eval
    return build_trainer(plan, load_previous_on_corruption=load_previous_on_corruption).fit()
