"""The run's process-wide settings (torch threads, the CPU linear kernel) are chosen when the run
starts, recorded in ``run.json`` and in every checkpoint, kept by a resume, and undone when the run
ends (:class:`posttrain.loops.session.Session`)."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.checkpoint import read_trainer_state
from posttrain.host_memory import glibc
from posttrain.models import cpu_linear, packed_linear
from tests.helpers.runs import world_run_config


def _train(world, run, monkeypatch, kernel: str | None, iters: int = 1, **sections) -> None:
    from posttrain.commands.train import train_config

    if kernel is None:
        monkeypatch.delenv(cpu_linear.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_linear.ENV, kernel)
    train_config(world_run_config(world, run, iters=iters, **sections))


@pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear")
def test_the_kernel_is_recorded_installed_for_the_run_only_and_kept_by_a_resume(mini_world, tmp_path, monkeypatch):
    threads, calls = torch.get_num_threads(), []
    assert cpu_linear.installed() == "blas"
    onednn = cpu_linear._forward

    def counted(self, x):
        calls.append(1)
        return onednn(self, x)

    monkeypatch.setattr(cpu_linear, "_forward", counted)  # what use_cpu_linear("onednn") installs
    monkeypatch.setenv(packed_linear.ENV, "on")  # and the rollout on prepacked weights
    run = tmp_path / "run"
    _train(mini_world, run, monkeypatch, "onednn", rl_config={"num_threads": 1})
    assert calls  # the run's linear layers computed through oneDNN
    assert cpu_linear.installed() == "blas" and torch.get_num_threads() == threads  # undone at the end
    info = json.loads((run / "out" / "run.json").read_text())
    assert info["cpu_linear"] == "onednn" and info["num_threads"] == 1
    assert info["compile_regions"] is False  # rl_config.compile_regions, off by default
    assert info["rollout_packed_weights"] is packed_linear.available()  # fp32 or bf16 rollout, on a CPU
    assert info["keep_freed_memory"] is (glibc() is not None)  # a CPU run reuses freed memory (host_memory)
    assert read_trainer_state(run / "ckpt" / "iter_0000001")["cpu_linear"] == "onednn"
    # a resume with nothing pinned keeps the kernel the checkpoint recorded (not a new measurement)
    monkeypatch.setattr(cpu_linear, "speedup", lambda *a, **k: 0.0)  # a measurement would now say blas
    _train(mini_world, run, monkeypatch, None, iters=2, actor_config={"load": str(run / "ckpt"), "finetune": False},
           rl_config={"compile_regions": "auto"})
    info = json.loads((run / "out" / "run.json").read_text())
    assert info["cpu_linear"] == "onednn" and info["compile_regions"] == "auto"
    # auto, on a tiny model with one update left: no region's eager time can pay for its compile
    assert info["compiled_regions"] and not any(c["on"] or c["compiled_s"] for c in info["compiled_regions"].values())
    assert all("less than the compile" in c["reason"] for c in info["compiled_regions"].values())
    assert read_trainer_state(run / "ckpt" / "iter_0000002")["cpu_linear"] == "onednn"
    assert cpu_linear.installed() == "blas"


def test_use_cpu_linear_restores_the_kernel_installed_before():
    before = torch.nn.Linear.forward
    with cpu_linear.use_cpu_linear("onednn" if cpu_linear.available() else "blas"):
        with cpu_linear.use_cpu_linear("blas"):
            assert cpu_linear.installed() == "blas"
    assert torch.nn.Linear.forward is before


def test_a_pinned_kernel_wins_over_the_stored_one_and_cuda_is_always_blas(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "blas")
    assert cpu_linear.resolve_cpu_linear("cpu", stored="onednn") == "blas"
    monkeypatch.delenv(cpu_linear.ENV)
    assert cpu_linear.resolve_cpu_linear("cuda", stored="onednn") == "blas"
    want = "onednn" if cpu_linear.available() else "blas"
    assert cpu_linear.resolve_cpu_linear("cpu", stored="onednn") == want
