"""The wheel works outside the clone: built from this checkout, installed into a clean target folder,
and run from an empty directory as a user would, through its ``posttrain`` script: ``plan`` on a
shipped seed recipe, ``init-model``, ``preprocess`` with a shipped dataset config and template,
and a 2-iteration GRPO ``train`` on the tiny config. Nothing may come from the checkout (the
editable install of the test venv is shadowed by the target, and the test checks that it is)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.paths import PROJECT_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(the install's ``bin/posttrain``, the environment that runs it)."""
    root = tmp_path_factory.mktemp("wheel")
    wheels, target, source = root / "dist", root / "site", root / "source"
    # a copy of what the wheel is built from, so that no build/ folder of the checkout (stale files) leaks in
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(PROJECT_ROOT / "src", source / "src", symlinks=True, ignore=skip)
    shutil.copytree(PROJECT_ROOT / "configs", source / "configs", ignore=skip)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (PROJECT_ROOT / name).is_file():
            shutil.copy(PROJECT_ROOT / name, source / name)
    # no build isolation: the venv's setuptools builds it offline, as fast as it can
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels)], check=True, capture_output=True)
    (wheel,) = wheels.glob("posttrain-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("POSTTRAIN_CONFIGS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return target / "bin" / "posttrain", env


def run(installed, cwd: Path, *args: str) -> str:
    script, env = installed
    out = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, (args, out.stdout[-2000:], out.stderr[-3000:])
    return out.stdout + out.stderr


def test_the_installed_wheel_plans_builds_preprocesses_and_trains_from_an_empty_directory(installed, tmp_path):
    script, env = installed
    where = subprocess.run([sys.executable, "-c", "import posttrain, posttrain.paths as p; "
                            "print(posttrain.__file__); print(p.configs_dir())"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout.split()
    target = str(script.parent.parent)
    assert all(path.startswith(target) for path in where), where  # the install's code and configs, not the clone's
    assert run(installed, tmp_path, "--version").strip().endswith(__import__("posttrain").__version__)

    planned = run(installed, tmp_path, "plan", "--config-name", "grpo_qwen25_32b_A2", "--target", "npu:64GiB",
                  "--nodes", "2", "--devices-per-node", "8")
    assert "npu:64GiB" in planned and "total" in planned

    run(installed, tmp_path, "init-model", "--model", "tiny_qwen2", "--output", "model", "--seed", "1")
    assert (tmp_path / "model" / "config.json").is_file()
    rows = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in (1, 2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(installed, tmp_path, "preprocess", "--config-name", "tiny_add", "input=train.jsonl",
        "tokenizer_name_or_path=model", "output_prefix=data/rl")  # the shipped tiny_math template
    assert list(tmp_path.glob("data/rl*.bin"))

    run(installed, tmp_path, "train", "--config-name", "grpo_tiny_qwen2", "megatron_training.tokenizer_name_or_path=model",
        "megatron_training.data_path=data/rl", "megatron_training.train_iters=2", "actor_config.load=model",
        "actor_config.save=ckpt", "rl_config.output_dir=out", "rl_config.eval_data_path=null",
        "megatron_training.save_interval=2", "rl_config.use_tensorboard=false")
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics if "actor/pg_loss" in m] == [1, 2]
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()
