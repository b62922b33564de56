"""A small world for the reliability tests (tests/unit/infra/test_reliability_*.py): the mini Qwen2
of tests/conftest.py, a prompt dataset, and a GRPO config that runs an iteration in about a second.

``world`` (module scope) builds the model and data once; ``base`` trains 2 iterations with a save
at each (``base/ckpt``: iter_0000001, iter_0000002, tracker 2; ``base/out/metrics.jsonl``) for the
tests that damage or reuse a checkpoint (they work on copies: :func:`copy_run`).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import yaml


@pytest.fixture(scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls thrash with 2 threads on a loaded 2-core box
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory, mini_qwen2_dir, one_thread) -> Path:
    from posttrain.data.preprocess import preprocess

    root = tmp_path_factory.mktemp("reliability")
    shutil.copytree(mini_qwen2_dir, root / "model")
    rng = random.Random(0)
    rows = []
    for _ in range(32):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
    (root / "rl.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    preprocess({"input": str(root / "rl.jsonl"), "handler_name": "R1AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(root / "model"), "prompt_type": "trl", "workers": 1,
                "output_prefix": str(root / "data" / "rl"), "map_keys": {"prompt": "problem", "response": "answer"},
                "dataset_additional_keys": ["labels"]}, progress=False)
    return root


def config_dict(world: Path, run: Path, iters: int = 2, **sections) -> dict:
    """The GRPO config of a run whose checkpoints go to ``run/ckpt`` and logs to ``run/out``;
    ``sections`` update a section (``megatron_training={...}``)."""
    cfg = {
        "megatron_training": {"stage": "ray_grpo", "global_batch_size": 2, "micro_batch_size": 4, "seq_length": 64,
                              "train_iters": iters, "lr": 1e-3, "lr_decay_style": "constant", "weight_decay": 0.0,
                              "tokenizer_name_or_path": str(world / "model"), "data_path": str(world / "data" / "rl"),
                              "seed": 1, "bf16": False, "dataset_additional_keys": ["labels"], "prompt_type": "trl",
                              "save_interval": 1},
        "actor_config": {"save": str(run / "ckpt")},
        "rl_config": {"n_samples_per_prompt": 2, "mini_batch_size": 2, "verifier_function": ["last_number"],
                      "verifier_weight": [1.0], "verifier_parallel": 0, "init_kl_coef": 0.0, "max_prompt_length": 64,
                      "output_dir": str(run / "out"), "device": "cpu"},
        "generate_config": {"max_model_len": 64, "max_num_seqs": 16, "infer_tensor_parallel_size": 1,
                            "sampling_config": {"max_tokens": 4, "temperature": 1.0, "top_k": -1, "top_p": 1.0}},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def run_config(world: Path, run: Path, iters: int = 2, **sections):
    from posttrain.config.run import run_config_from_dict

    return run_config_from_dict(config_dict(world, run, iters, **sections), name="reliability")


def write_config(world: Path, run: Path, iters: int = 2, **sections) -> list[str]:
    """The config as a YAML file under ``run``; returns the ``--config-path/--config-name`` arguments."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "grpo.yaml").write_text(yaml.safe_dump(config_dict(world, run, iters, **sections)))
    return ["--config-path", str(run), "--config-name", "grpo"]


def resume_args(run: Path, iters: int = 3) -> list[str]:
    """Overrides that resume ``run/ckpt`` in place."""
    return [f"actor_config.load={run / 'ckpt'}", "actor_config.finetune=false",
            f"megatron_training.train_iters={iters}"]


@pytest.fixture(scope="module")
def base(world) -> Path:
    from posttrain.trainers.stages import train

    run = world / "base"
    train(run_config(world, run, iters=2))
    assert (run / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    return run


def copy_run(base: Path, dest: Path) -> Path:
    """A copy of the base run (its checkpoints and logs) to damage or resume."""
    shutil.copytree(base / "ckpt", dest / "ckpt")
    shutil.copytree(base / "out", dest / "out")
    return dest


def metrics_iterations(run: Path, name: str = "metrics.jsonl") -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "out" / name).read_text().splitlines() if line.strip()]
