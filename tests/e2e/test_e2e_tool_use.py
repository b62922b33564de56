"""Multi-turn tool use that learns, end to end (python -m posttrain.demo.tool_use, shrunk for CI).

A tiny Qwen2 gets an SFT warm start on synthetic code-interpreter traces that solves 40-50% of a
validation split (the first checkpoint that reaches 40%, or a blend of it with the one before when
the SFT's jump passes 50% between two saves: the cap holds whatever the CPU's kernels), then DAPO
with the code interpreter in the sandbox on products of two 3-digit numbers. DAPO must beat the warm start by 8 points of greedy
held-out accuracy (1.7 binomial standard deviations; +10 to +15 measured); the same models without the tool stay near 0 (the task needs it). A run resumed
from its last-but-one checkpoint must repeat the uninterrupted run's last iteration.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import read_metrics

pytestmark = pytest.mark.slow
ITERS = 8
# CI size: dynamic sampling off (one generation batch per iteration); checkpoints at ITERS - 1 and ITERS
OVERRIDES = ("rl_config.filter_groups_enable=false", f"megatron_training.save_interval={ITERS - 1}")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, dict]:
    from posttrain.errors import ConfigError
    from posttrain.tools.sandbox import detect_sandbox

    try:
        detect_sandbox()
    except ConfigError as err:
        pytest.skip(f"no sandbox on this host: {err}")
    from posttrain.demo.tool_use import run

    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("tool_use")
    return out, run(out, iters=ITERS, seed=1, num_test=100, overrides=OVERRIDES)


def test_dapo_with_the_code_tool_learns_over_its_warm_start(demo):
    _, s = demo
    sft, rl = s["sft"], s["rl"]
    assert 0.4 <= s["sft_val_accuracy"] <= 0.5 and sft["tool"]["accuracy"] <= 0.65, s  # a capped warm start
    # 8 more of 100 held-out problems (1.7 binomial standard deviations at 70%): the runs are
    # deterministic per machine, but CPU kernels differ between machines (+15 on a Xeon, +10 on an EPYC)
    assert round(100 * (rl["tool"]["accuracy"] - sft["tool"]["accuracy"])) >= 8, s
    assert rl["tool"]["tool_calls"] >= 0.9  # it answers through the tool
    assert sft["no_tool"]["accuracy"] <= 0.05 and rl["no_tool"]["accuracy"] <= 0.05, s  # the no-tool baseline
    assert s["rewards"][-1] > s["rewards"][0]
    rows = read_metrics(demo[0] / "rl")
    for key in ("tool_call_num/mean", "tool_call_num/max", "tool_call_num/min", "timing/tool", "tool/calls",
                "tool/seconds_per_call"):
        assert key in rows[-1], key


def test_a_resumed_multi_turn_run_repeats_the_uninterrupted_one(demo):
    from posttrain.checkpoint import iter_dir_name
    from posttrain.config.run import load_run_config
    from posttrain.paths import configs_dir
    from posttrain.commands.train import train_config as train

    out, s = demo
    resumed = out / "resumed_ckpt"
    shutil.copytree(out / "rl_ckpt" / iter_dir_name(ITERS - 1), resumed / iter_dir_name(ITERS - 1))
    (resumed / "latest_checkpointed_iteration.txt").write_text(str(ITERS - 1))
    cfg = load_run_config("dapo_tiny_multi_turn", None, [
        f"megatron_training.tokenizer_name_or_path={s['model']}", f"megatron_training.data_path={out / 'data/rl/data'}",
        f"megatron_training.prompt_type_path={configs_dir() / 'tiny_templates.json'}",
        f"actor_config.load={resumed}", f"actor_config.save={resumed}", "actor_config.finetune=false",
        f"rl_config.output_dir={out / 'resumed'}", f"megatron_training.train_iters={ITERS}", *OVERRIDES])
    train(cfg)
    straight = read_metrics(out / "rl")[-1]
    again = read_metrics(out / "resumed")[-1]
    assert again["iteration"] == straight["iteration"] == ITERS
    keys = [k for k in straight if not (k.startswith(("timing/", "tool/seconds")) or k.endswith("_tps") or k == "time")]
    assert "actor/pg_loss" in keys and "tool_call_num/mean" in keys
    for k in keys:
        assert again[k] == pytest.approx(straight[k], rel=1e-5, abs=1e-7), k
