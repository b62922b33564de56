"""Configs and run recorders for the Ray tests (imported by the test modules)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.configs import run_config
from tests.helpers.runs import read_metrics


def grpo_config(work: Path, name: str, *, workers: int, iters: int, rl: dict | None = None, train: dict | None = None,
                sections: dict | None = None):
    """GRPO on the lowercase-fraction reward (tests/helpers/configs.py): 4 prompts x 8 samples, 2 optimizer
    steps per iteration, on ``workers`` Ray actor workers."""
    return run_config(work / "model", work / "prompts/data", work / f"run_{name}", name=name, iters=iters,
                      megatron_training=train or {},
                      rl_config={"actor_resource": {"num_devices": workers}, "ray_timeout_s": 120, **(rl or {})},
                      **(sections or {}))


def session_and_trainer(cfg):
    """The trainer of ``cfg`` (and its session), built but not run."""
    from posttrain.config.plan import resolve_plan
    from posttrain.loops.build import build_trainer

    trainer = build_trainer(resolve_plan(cfg, device="cpu"))
    return trainer.s, trainer


def sample(trainer, td, iteration: int = 1) -> None:
    """Prompts and their samples into ``td``, as iteration ``iteration`` of ``trainer`` makes them
    with the trainer's weights now."""
    from posttrain.metrics.reduce import MetricAccumulator
    from posttrain.metrics.timers import Timers

    trainer.producer.generation.fill(td, iteration, trainer.s.policy.rollout, iteration - 1, Timers(),
                                     MetricAccumulator())


def column(td, name):
    """Every row of one TransferDock column, flattened."""
    import torch

    batch, _ = td.get("metrics", [name], indexes=list(range(td.max_len)))
    return torch.cat([r.reshape(-1) for r in batch[name]])


def record_run(cfg, sessions: list | None = None,
               reward_model_scores: list | None = None,
               update_batches: list | None = None) -> tuple[list[list[list[int]]], list[dict], list[dict]]:
    """Train ``cfg``; return the response token ids of every generation batch, the logged metrics
    and the metrics of every actor optimizer step (the run's session is appended to ``sessions``:
    on Ray, ``session.cluster.info`` says where each worker ran; the reward model's scores of
    ``reward_config``, call by call, to ``reward_model_scores``; the batch of every actor update to
    ``update_batches``)."""
    session, trainer = session_and_trainer(cfg)
    if sessions is not None:
        sessions.append(session)
    if reward_model_scores is not None:
        score = session.reward_model.score_sequences

        def recording_scores(*args):
            out = score(*args)
            reward_model_scores.append(list(out))
            return out

        session.reward_model.score_sequences = recording_scores
    batches, steps = [], []
    generation = trainer.producer.generation
    fill, update = generation.fill, session.policy.actor.update

    def recording_generation(td, *args):
        fill(td, *args)
        rows, _ = td.get("metrics", ["responses"], indexes=list(range(td.max_len)))
        batches.append([r.tolist() for r in rows["responses"]])

    def recording_update(*args, **kwargs):
        if update_batches is not None:
            update_batches.append({k: v.clone() for k, v in args[0].items()})
        out = update(*args, **kwargs)
        steps.extend(out)
        return out

    generation.fill = recording_generation  # DAPO's dynamic sampler generates once per generation batch
    session.policy.actor.update = recording_update
    trainer.fit()
    return batches, read_metrics(Path(cfg.rl.output_dir)), steps
