"""A missing optional package names the extra that installs it (posttrain.extras)."""

from __future__ import annotations

import pytest

from posttrain import extras
from posttrain.errors import ConfigError


def test_a_missing_package_names_its_extra(monkeypatch):
    monkeypatch.setattr(extras, "installed", lambda module: module != "megatron.core")
    extras.require("ray", "Ray")  # installed: nothing
    with pytest.raises(ConfigError, match=r"the megatron backend needs the megatron.core package.*posttrain\[megatron\]"):
        extras.require("megatron.core", "the megatron backend")


def test_the_megatron_backend_without_megatron_core_is_refused_by_the_config_check(monkeypatch):
    from posttrain.config.check import Refusals, collect_checks
    from posttrain.config.placement_table import TINY_ARCH
    from posttrain.config.run import load_run_config

    cfg = load_run_config("grpo_tiny_qwen2", overrides=["rl_config.actor_resource.num_npus=2",
                                                        "megatron_training.backend=megatron",
                                                        "megatron_training.tensor_model_parallel_size=2"])
    monkeypatch.setattr(extras, "installed", lambda module: module != "megatron.core")
    refusals = Refusals()
    collect_checks(cfg, refusals, arch=TINY_ARCH)
    assert any("pip install 'posttrain[megatron]'" in m for m in refusals.messages), refusals.messages
    refusals = Refusals()
    collect_checks(cfg, refusals, arch=TINY_ARCH, here=False)  # planned for another machine: its packages
    assert not any("posttrain[megatron]" in m for m in refusals.messages), refusals.messages


def test_every_extra_named_is_declared_in_pyproject():
    import tomllib

    from posttrain.paths import PROJECT_ROOT

    declared = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {extra for extra, _ in extras.EXTRAS.values()} <= set(declared)


def test_data_strategy_tq_without_transferqueue_is_refused_by_the_config_check(monkeypatch):
    from posttrain.config.check import Refusals, collect_checks
    from posttrain.config.placement_table import TINY_ARCH
    from posttrain.config.run import load_run_config

    cfg = load_run_config("grpo_tiny_qwen2", overrides=["rl_config.data_strategy=tq"])
    monkeypatch.setattr(extras, "installed", lambda module: module != "transfer_queue")
    refusals = Refusals()
    collect_checks(cfg, refusals, arch=TINY_ARCH)
    assert any("rl_config.data_strategy: tq (TransferQueue) needs the transfer_queue package" in m
               and "pip install 'posttrain[tq]'" in m for m in refusals.messages), refusals.messages
    monkeypatch.setattr(extras, "installed", lambda module: True)
    refusals = Refusals()
    collect_checks(cfg, refusals, arch=TINY_ARCH)
    assert not any("posttrain[tq]" in m for m in refusals.messages), refusals.messages
