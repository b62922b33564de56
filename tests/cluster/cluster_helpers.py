"""Configs and readers for the Ray tests (imported by the test modules)."""

from __future__ import annotations

import json
from pathlib import Path


def grpo_config(work: Path, name: str, *, workers: int, iters: int, rl: dict | None = None, train: dict | None = None,
                sections: dict | None = None):
    """GRPO on the lowercase-fraction reward: 4 prompts x 8 samples, 2 optimizer steps per iteration."""
    from posttrain.config.run import run_config_from_dict

    rl_config = {"output_dir": str(work / f"run_{name}"), "n_samples_per_prompt": 8, "mini_batch_size": 2,
                 "verifier_function": ["e2e_lowercase"], "verifier_weight": [1.0],
                 "verifier_modules": ["e2e_algo_verifiers"], "init_kl_coef": 0.0, "max_prompt_length": 64,
                 "verifier_parallel": 1, "device": "cpu", "actor_resource": {"num_devices": workers},
                 "ray_timeout_s": 120, **(rl or {})}
    training = {"stage": "ray_grpo", "global_batch_size": 4, "micro_batch_size": 8, "seq_length": 64,
                "train_iters": iters, "lr": 3e-3, "lr_decay_style": "constant", "weight_decay": 0.0,
                "data_path": str(work / "prompts/data"), "tokenizer_name_or_path": str(work / "model"), "seed": 1,
                "bf16": False, "dataset_additional_keys": ["labels"], "prompt_type": "trl", **(train or {})}
    return run_config_from_dict({
        "megatron_training": training, "rl_config": rl_config,
        "generate_config": {"max_model_len": 64, "max_num_seqs": 256, "infer_tensor_parallel_size": 1,
                            "sampling_config": {"max_tokens": 12, "temperature": 1.0, "top_k": -1, "top_p": 1.0}},
        **(sections or {})}, name=name)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def session_and_trainer(cfg):
    """The trainer of ``cfg`` (and its session), built but not run."""
    from posttrain.config.plan import resolve_plan
    from posttrain.trainers.build import build_trainer

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


def record_run(cfg) -> tuple[list[list[list[int]]], list[dict], list[dict]]:
    """Train ``cfg``; return the response token ids of every generation batch, the logged metrics
    and the metrics of every actor optimizer step."""
    session, trainer = session_and_trainer(cfg)
    batches, steps = [], []
    generation = trainer.producer.generation
    fill, update = generation.fill, session.policy.actor.update

    def recording_generation(td, *args):
        fill(td, *args)
        rows, _ = td.get("metrics", ["responses"], indexes=list(range(td.max_len)))
        batches.append([r.tolist() for r in rows["responses"]])

    def recording_update(*args, **kwargs):
        out = update(*args, **kwargs)
        steps.extend(out)
        return out

    generation.fill = recording_generation  # DAPO's dynamic sampler generates once per generation batch
    session.policy.actor.update = recording_update
    trainer.fit()
    return batches, read_metrics(Path(cfg.rl.output_dir)), steps
