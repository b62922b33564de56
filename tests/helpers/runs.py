"""Running ``posttrain`` in process, reading what a run wrote, and the mini world's GRPO run.

The mini world (the ``mini_world`` fixture of tests/conftest.py) is the mini Qwen2 of tests/conftest.py
and 32 addition prompts; :func:`world_run_dict` is a GRPO run on it that takes about a second an
iteration, with checkpoints in ``run/ckpt`` and logs in ``run/out``. The ``base_run`` fixture trains
it for 2 iterations with a save at each, for the tests that damage or resume a checkpoint (on a copy:
:func:`copy_run`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from tests.helpers.configs import OMIT, run_dict


# ---- posttrain in process ----------------------------------------------------------------------------
def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``posttrain ARGV`` in process: (exit status, stderr). A user error never prints a traceback."""
    from posttrain.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


def forbid(monkeypatch, target: str) -> None:
    """Make ``target`` (module:attr) fail the test if called: the command must stop before the work."""
    module, attr = target.split(":")

    def called(*a, **k):
        raise AssertionError(f"{target} ran: the output path was not checked before the work")

    monkeypatch.setattr(f"{module}.{attr}", called)


def tree(path: Path) -> list[str]:
    """Every path under ``path``, relative to it, sorted."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ---- what a run wrote -----------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_metrics(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (a run's ``rl_config.output_dir``), in order."""
    return read_jsonl(Path(run_dir) / name)


def metrics_by_iteration(run_dir: Path) -> dict[int, dict]:
    """The rows of the iterations that updated the actor (they hold ``actor/pg_loss``), by iteration."""
    return {r["iteration"]: r for r in read_metrics(run_dir) if "actor/pg_loss" in r}


# ---- the mini world's GRPO run ---------------------------------------------------------------------------
def world_run_dict(world: Path, run: Path, iters: int = 2, **sections) -> dict:
    """The GRPO config of a run on the mini world whose checkpoints go to ``run/ckpt`` (saved every
    iteration) and logs to ``run/out``: 2 prompts x 2 samples of 4 tokens, the ``last_number`` verifier in
    process; ``sections`` update a section (``megatron_training={...}``)."""
    cfg = run_dict(world / "model", world / "data" / "rl", run / "out", iters=iters,
                   megatron_training={"global_batch_size": 2, "micro_batch_size": 4, "lr": 1e-3, "save_interval": 1},
                   actor_config={"save": str(run / "ckpt")},
                   rl_config={"n_samples_per_prompt": 2, "verifier_function": ["last_number"], "verifier_modules": OMIT,
                              "verifier_parallel": 0},
                   generate_config={"max_num_seqs": 16, "sampling_config": {"max_tokens": 4, "temperature": 1.0,
                                                                            "top_k": -1, "top_p": 1.0}})
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def world_run_config(world: Path, run: Path, iters: int = 2, **sections):
    """:func:`world_run_dict` as a ``RunConfig``."""
    from posttrain.config.run import run_config_from_dict

    return run_config_from_dict(world_run_dict(world, run, iters, **sections), name="reliability")


def write_config(world: Path, run: Path, iters: int = 2, **sections) -> list[str]:
    """:func:`world_run_dict` as a YAML file under ``run``; returns the ``--config-path/--config-name``
    arguments."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "grpo.yaml").write_text(yaml.safe_dump(world_run_dict(world, run, iters, **sections)))
    return ["--config-path", str(run), "--config-name", "grpo"]


def resume_args(run: Path, iters: int = 3) -> list[str]:
    """Overrides that resume ``run/ckpt`` in place."""
    return [f"actor_config.load={run / 'ckpt'}", "actor_config.finetune=false",
            f"megatron_training.train_iters={iters}"]


def copy_run(base: Path, dest: Path) -> Path:
    """A copy of the base run (its checkpoints and logs) to damage or resume."""
    shutil.copytree(base / "ckpt", dest / "ckpt")
    shutil.copytree(base / "out", dest / "out")
    return dest


def metrics_iterations(run: Path, name: str = "metrics.jsonl") -> list[int]:
    """The iterations of the rows in ``run/out/NAME``."""
    return [r["iteration"] for r in read_metrics(run / "out", name)]
