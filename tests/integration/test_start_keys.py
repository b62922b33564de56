"""How a run starts (issue 40 item 7), on one trained tiny GRPO run (1 iteration, saved, evaluated):

* ``skip_train`` (Megatron's ``--skip-train``): the run loads its checkpoint, evaluates it on the
  held-out set and stops: the same ``eval/*`` as the training run's own evaluation of those weights,
  no iteration logged, nothing saved;
* ``pretrained_checkpoint`` (Megatron's meaning): a fresh run starts from that checkpoint's weights
  only, at iteration 0 with a new optimizer (its Adam step count restarts) and goes on like a run
  started with ``load`` + ``finetune`` (the seed's weights-only load), metric for metric.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import metrics_by_iteration, read_jsonl, read_metrics
from tests.integration.test_grpo_loop import grpo_config

def _config(model, data, out: Path, **over):
    """The loop tests' GRPO run, evaluated on 4 of its own prompts."""
    return grpo_config(model, data, out, rl_config__eval_data_path=data, rl_config__eval_limit=4, **over)


@pytest.fixture(scope="module")
def trained(mini_qwen2_dir, tiny_prompt_data, tmp_path_factory) -> Path:
    """One GRPO iteration of the mini model, saved in ``base/ckpt`` and evaluated before and after."""
    from posttrain.commands.train import train_config as train

    out = tmp_path_factory.mktemp("start_keys") / "base"
    train(_config(mini_qwen2_dir, tiny_prompt_data, out, megatron_training__train_iters=1))
    return out


def _adam_steps(checkpoint: Path) -> int:
    state = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    return int(next(iter(state["state"].values()))["step"])


def test_skip_train_only_evaluates_the_loaded_checkpoint(trained, mini_qwen2_dir, tiny_prompt_data, tmp_path):
    from posttrain.commands.train import train_config as train

    want = read_jsonl(trained / "run" / "eval.jsonl")[-1]  # the final evaluation, of the saved weights
    assert want["iteration"] == 1
    got = train(_config(mini_qwen2_dir, tiny_prompt_data, tmp_path, megatron_training__skip_train=True,
                        actor_config__load=str(trained / "ckpt"), megatron_training__train_iters=3))
    assert got and got == {k: v for k, v in want.items() if k.startswith("eval/")}
    assert [r["iteration"] for r in read_jsonl(tmp_path / "run" / "eval.jsonl")] == [1]
    assert not any("actor/pg_loss" in row for row in read_metrics(tmp_path / "run"))  # no iteration ran
    assert not list((tmp_path / "ckpt").glob("*iter*"))  # nothing saved (no iter_*, no tracker file)


def test_pretrained_checkpoint_starts_fresh_from_its_weights(trained, mini_qwen2_dir, tiny_prompt_data, tmp_path):
    from posttrain.commands.train import train_config as train

    ckpt = trained / "ckpt"
    steps = _adam_steps(ckpt / "iter_0000001")
    runs = {"pretrained": dict(megatron_training__pretrained_checkpoint=str(ckpt)),
            "finetune": dict(actor_config__load=str(ckpt), megatron_training__finetune=True)}
    for name, keys in runs.items():
        train(_config(mini_qwen2_dir, tiny_prompt_data, tmp_path / name, megatron_training__train_iters=1, **keys))
    start = read_jsonl(trained / "run" / "eval.jsonl")[-1]
    for name in runs:
        run = tmp_path / name
        evals = read_jsonl(run / "run" / "eval.jsonl")
        assert evals[0]["iteration"] == 0 and evals[0]["eval/score/mean"] == start["eval/score/mean"]  # its weights
        state = json.loads((run / "ckpt" / "iter_0000001" / "trainer_state.json").read_text())
        assert state["iteration"] == 1  # started at iteration 0, not at the checkpoint's 1
        assert _adam_steps(run / "ckpt" / "iter_0000001") == steps  # a fresh optimizer, not 2 x steps
    a, b = (metrics_by_iteration(tmp_path / name / "run")[1] for name in runs)
    for key in ("actor/pg_loss", "actor/kl_loss", "grpo/score/mean", "actor/grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


def test_pretrained_checkpoint_gives_way_to_a_checkpoint_to_resume(trained, mini_qwen2_dir, tmp_path):
    """Once ``load`` holds the run's checkpoint the run resumes from it; model weights in ``load``
    beside ``pretrained_checkpoint`` name two starts, refused naming both keys."""
    from posttrain.config.megatron import MegatronConfig
    from posttrain.config.options import checkpoint_load
    from posttrain.errors import ConfigError

    ckpt = str(trained / "ckpt")
    assert checkpoint_load(MegatronConfig(load=ckpt, pretrained_checkpoint=str(mini_qwen2_dir))).finetune is False
    fresh = checkpoint_load(MegatronConfig(load=str(tmp_path / "empty"), pretrained_checkpoint=ckpt))
    assert (fresh.load, fresh.finetune) == (ckpt, True)
    with pytest.raises(ConfigError, match="load=.* names model weights and pretrained_checkpoint="):
        checkpoint_load(MegatronConfig(load=str(mini_qwen2_dir), pretrained_checkpoint=ckpt))
