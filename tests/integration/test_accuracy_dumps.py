"""msprobe_config on tiny GRPO runs: ``posttrain compare-dumps`` finds nothing between two equal runs
and names the perturbed layer, and the step, between a run and the same run with one decoder
layer's weights perturbed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from posttrain.cli import main
from tests.helpers.configs import OMIT
from tests.integration.test_grpo_loop import grpo_config

DUMPS = {"msprobe": True, "key_data_dump": True, "configurations_dump": True, "actor_infer_dump": True,
         "actor_train_dump": True, "reference_dump": True}


def perturbed_copy(model_dir, out, layer: int):
    """``model_dir`` with noise (std 1e-3) added to decoder layer ``layer``'s MLP down projection."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    weight = model.model.layers[layer].mlp.down_proj.weight
    with torch.no_grad():
        weight.add_(1e-3 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dumped_runs(mini_qwen2_dir, tiny_prompt_data, tmp_path_factory):
    """Three one-iteration runs: ``a`` and ``b`` equal, ``c`` from the model with layer 1 perturbed; two
    mini-batches an iteration, so the old log-probs (and the ratio) are computed."""
    from posttrain.commands.train import train_config as train

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("dumps")
    models = {"a": mini_qwen2_dir, "b": mini_qwen2_dir, "c": perturbed_copy(mini_qwen2_dir, root / "perturbed", 1)}
    for name, model in models.items():
        out = root / name
        train(grpo_config(model, tiny_prompt_data, out, megatron_training__save=OMIT,
                          megatron_training__save_interval=OMIT,
                          rl_config__mini_batch_size=1, **{f"msprobe_config__{k}": v for k, v in DUMPS.items()},
                          msprobe_config__dump_path=str(out / "dump")))
    return root


def test_equal_runs_compare_equal(dumped_runs, capsys):
    assert main(["compare-dumps", str(dumped_runs / "a" / "dump"), str(dumped_runs / "b" / "dump")]) == 0
    assert "the dumps agree" in capsys.readouterr().out
    config = json.loads((dumped_runs / "a" / "dump" / "configurations.json").read_text())
    assert config["msprobe_config"]["actor_infer_dump"] is True
    roles = sorted(p.stem for p in (dumped_runs / "a" / "dump" / "step_1" / "rank_0").glob("*.jsonl"))
    assert roles == ["actor_infer", "actor_train", "key_data", "reference"]
    names = {json.loads(line)["name"] for line in (dumped_runs / "a/dump/step_1/rank_0/key_data.jsonl").open()}
    assert {"prompts", "responses", "advantages", "ref_logprobs", "logprobs", "ratio", "loss", "actor/pg_loss",
            "actor/grad_norm", "grad/model.layers.0.mlp.down_proj.weight"} <= names


def test_compare_dumps_names_the_perturbed_layer(dumped_runs, capsys):
    assert main(["compare-dumps", str(dumped_runs / "a" / "dump"), str(dumped_runs / "c" / "dump")]) == 1
    out = capsys.readouterr().out
    # the rollout's prefill is the first computation that sees the noise: layer 1's down projection
    assert "first difference: step 1, rank 0, role actor_infer (phase rollout), model.layers.1.mlp.down_proj " \
           "output (call 0)" in out, out


def test_ppo_dumps_the_critic(mini_qwen2_dir, tiny_prompt_data, tmp_path):
    """critic_train_dump: the critic's modules in its value pass and its update; key data: its values and loss."""
    from posttrain.commands.train import train_config as train

    dump = tmp_path / "dump"
    train(grpo_config(mini_qwen2_dir, tiny_prompt_data, tmp_path, megatron_training__save=OMIT,
                      megatron_training__save_interval=OMIT, megatron_training__stage="ray_ppo",
                      rl_config__adv_estimator="gae", msprobe_config__msprobe=True, msprobe_config__key_data_dump=True,
                      msprobe_config__critic_train_dump=True, msprobe_config__dump_path=str(dump)))
    folder = dump / "step_1" / "rank_0"
    assert sorted(p.stem for p in folder.glob("*.jsonl")) == ["critic_train", "key_data"]
    critic = [json.loads(line) for line in (folder / "critic_train.jsonl").open()]
    assert {r["phase"] for r in critic} == {"critic_model", "update_critic"}
    assert any(r["name"].endswith("layers.1.mlp.down_proj") for r in critic)
    names = {json.loads(line)["name"] for line in (folder / "key_data.jsonl").open()}
    assert {"values", "returns", "advantages", "critic/values", "critic/loss", "loss"} <= names


def test_dpo_dumps_its_batch_reference_update_and_loss(mini_qwen2_dir, tmp_path):
    """The offline loop: the batch (with the reference's log-probs), the reference's and the actor's
    modules, the update's metrics; at step 1 the policy is the reference, so the DPO loss is log 2."""
    import random

    from posttrain.commands.train import train_config as train
    from posttrain.data.preprocess import preprocess
    from tests.helpers.configs import run_config
    from tests.helpers.data import letter_pair, write_jsonl

    rng = random.Random(0)
    write_jsonl(tmp_path / "pairs.jsonl", [letter_pair(rng) for _ in range(8)])
    preprocess(dict(input=str(tmp_path / "pairs.jsonl"), handler_name="AlpacaStylePairwiseHandler",
                    output_prefix=str(tmp_path / "pairs/data"), tokenizer_name_or_path=str(mini_qwen2_dir),
                    map_keys={"prompt": "problem", "chosen": "chosen", "rejected": "rejected"}, prompt_type="trl",
                    workers=1), progress=False)
    dump = tmp_path / "dump"
    train(run_config(mini_qwen2_dir, tmp_path / "pairs/data", tmp_path / "run", stage="dpo", iters=1,
                     megatron_training={"global_batch_size": 4, "micro_batch_size": 2, "lr": 1e-2,
                                        "dataset_additional_keys": OMIT, "prompt_type": OMIT,
                                        "is_pairwise_dataset": True, "dpo_beta": 0.5},
                     msprobe_config={"msprobe": True, "key_data_dump": True, "actor_train_dump": True,
                                     "reference_dump": True, "dump_path": str(dump)}))
    folder = dump / "step_1" / "rank_0"
    records = {p.stem: [json.loads(line) for line in p.open()] for p in folder.glob("*.jsonl")}
    assert sorted(records) == ["actor_train", "key_data", "reference"]
    assert {r["phase"] for r in records["reference"]} == {"reference_model"}
    assert {r["phase"] for r in records["actor_train"]} == {"update"}
    key = {r["name"]: r for r in records["key_data"]}
    assert {"ref_chosen_logps", "ref_rejected_logps", "dpo/grad_norm", "grad/model.layers.1.mlp.down_proj.weight"} \
        <= set(key)
    assert key["dpo/loss"]["mean"] == pytest.approx(0.693147, abs=1e-4)
