"""Every seed recipe shipped in configs/, planned for its own hardware (``posttrain plan --target
npu:64GiB`` with the seed's nodes; posttrain.commands.seed_plans): the verdicts pinned by the keys
each refusal names, the memory checks consistent with the estimate, and the table in
docs/parallelism.md up to date.

The memory estimate's formulas change as posttrain's storage does: nothing here hard-codes GiB.
The memory refusals are checked against :func:`posttrain.config.memory.estimate_memory` (refused
exactly when its total, or the rollout copy, is above the device), the other refusals by key.
When a feature lands (offload_train_param on GPUs, MLA, context parallel, ...) its key leaves
``REFUSED_KEYS``.
"""

from __future__ import annotations

import glob
import os

import pytest

from posttrain.commands.seed_plans import (BEGIN, DOC_PATH, END, RECIPES, REGENERATE, SEED_RECIPES, header_block,
                                           plan_recipe, reason_key, render_table)
from posttrain.config.memory import estimate_memory
from posttrain.config.plan import GIB
from posttrain.config.run import load_run_config

MOE_TP_EP = "actor_config.moe_tp_extend_ep"
INFER_EP = "generate_config.infer_expert_parallel_size"  # vLLM (auto on a GPU): no expert-parallel rollout
CP = ["actor_config.context_parallel_size"]
DEEPSEEK = ["model.deepseekv3_671b.num_layers", MOE_TP_EP, INFER_EP, "model.deepseekv3_671b.multi_latent_attention"]
# the refusals other than the memory, by the key each names first
REFUSED_KEYS = {
    "r1_zero_qwen25_7b": [],
    "grpo_lora_qwen25_32b": [],
    "dapo_qwen25_7b_multi_turn": [],
    "dapo_qwen25_32b": [],
    "ppo_qwen25_32b": [],
    "dpo_qwen3_30b_a3b": [],
    "grpo_qwen25_7b_A3": [],
    "grpo_qwen25_32b_A2": [],
    "grpo_qwen25_32b_A3": [],
    "grpo_qwen3_8b_A3": [],
    "grpo_qwen3_235b_a22b_A2": [MOE_TP_EP, INFER_EP],
    "grpo_deepseek_r1_671b_A2": DEEPSEEK,
    "grpo_deepseek_r1_671b_A3": DEEPSEEK,
    "grpo_deepseek_r1_671b_A3_eplb": [*DEEPSEEK, "generate_config.torchair_graph", "generate_config.expert_map_path"],
    "dapo_qwen25_32b_A2_20k": CP,
    "dapo_qwen25_32b_A3_32k": CP,
    "dapo_qwen3_30b_a3b_A3": [MOE_TP_EP, INFER_EP],
    "dapo_qwen3_32b_A3": [],
}
MEMORY_KEYS = ("rollout copy larger than a device", "memory per device")
# the seed's recipes of MindSpeed-RL's configs/ at HEAD (seed_system.md section 1): each is shipped
SEED_FILES = ["grpo_qwen25_7b_A3", "grpo_qwen25_32b_A2", "grpo_qwen25_32b_A3", "grpo_lora_qwen25_32b_A2",
              "grpo_qwen3_8b_A3", "grpo_qwen3_235b_a22b_A2", "grpo_deepseek_r1_671b_A2", "grpo_deepseek_r1_671b_A3",
              "grpo_deepseek_r1_671b_A3_eplb", "dapo_qwen25_32b_A3", "dapo_qwen25_32b_A2_20k", "dapo_qwen25_32b_A3_32k",
              "dapo_qwen3_30b_a3b_A3", "dapo_qwen3_32b_A3", "dapo_qwen25_7b_A2_multi_turn", "ppo_qwen25_32b_A3",
              "dpo_qwen3_30b_a3b_A3"]
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "configs")


@pytest.fixture(scope="module")
def verdicts():
    return {r.name: plan_recipe(r) for r in SEED_RECIPES}


def test_every_seed_recipe_and_model_is_shipped():
    assert set(REFUSED_KEYS) == set(RECIPES)
    assert sorted(r.seed for r in SEED_RECIPES if r.seed != "r1_zero_qwen25_7b") == sorted(SEED_FILES)
    shipped = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CONFIGS, "*.yaml"))}
    assert set(RECIPES) <= shipped
    models = {os.path.basename(p)[:-5] for p in glob.glob(os.path.join(CONFIGS, "model", "*.yaml"))}
    assert {"qwen25_7b", "qwen25_32b", "qwen3_8b", "qwen3_32b", "qwen3_30b_a3b", "qwen3_235b_a22b",
            "deepseekv3_671b"} <= models


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_seed_recipe_on_its_own_hardware(verdicts, name):
    verdict = verdicts[name]
    keys = [reason_key(line) for line in verdict.reasons]
    assert sorted(k for k in keys if k not in MEMORY_KEYS) == sorted(REFUSED_KEYS[name]), verdict.reasons
    plan = verdict.plan
    assert plan is not None and plan.memory is not None  # every recipe's plan derives; its memory is known
    device = RECIPES[name].parsed_target().memory_bytes
    cfg = load_run_config(name)
    total = estimate_memory(cfg, plan, plan.arch).total  # the estimate function, independently of the verdict
    assert verdict.memory_per_device == total
    rollout_refused = plan.parallel.backend == "megatron" and plan.stage.on_policy and plan.memory.rollout_copy > device
    assert ("rollout copy larger than a device" in keys) == rollout_refused
    assert ("memory per device" in keys) == (total > device)
    if total > device:
        [line] = [r for r in verdict.reasons if r.startswith("the plan's memory estimate")]
        assert line.startswith(f"the plan's memory estimate, {total / GIB:,.2f} GiB per device")
    assert verdict.accepted == (not REFUSED_KEYS[name] and total <= device and not rollout_refused)
    if verdict.accepted:
        assert (plan.device, plan.train_dtype, plan.target.kind) == ("cuda", "bfloat16", "npu")


def test_the_recipes_that_need_what_posttrain_lacks_say_so(verdicts):
    """DeepSeek-V3 (MLA, on the megatron backend) and context parallel are refused with that reason,
    not by a crash."""
    for name in ("grpo_deepseek_r1_671b_A2", "grpo_deepseek_r1_671b_A3", "grpo_deepseek_r1_671b_A3_eplb"):
        assert any(r.startswith("model.deepseekv3_671b.multi_latent_attention: multi-latent attention "
                                "(DeepSeek-V3) is not mapped to Megatron-Core") for r in verdicts[name].reasons)
    for name in ("dapo_qwen25_32b_A2_20k", "dapo_qwen25_32b_A3_32k"):
        assert any(r.startswith("actor_config.context_parallel_size=2: context parallelism")
                   for r in verdicts[name].reasons)


def test_each_config_header_says_its_hardware_and_verdict(verdicts):
    """The header block of each recipe's config is what the code prints now (its command, its verdict)."""
    for recipe in SEED_RECIPES:
        text = open(os.path.join(CONFIGS, f"{recipe.name}.yaml"), encoding="utf-8").read()
        block = header_block(verdicts[recipe.name])
        assert recipe.command in block.replace("\n#   ", " ")
        assert block in text.split("\ndefaults:")[0] + "\n", f"{recipe.name}: stale header, run {REGENERATE}"


def test_the_docs_table_is_current(verdicts):
    doc = open(DOC_PATH, encoding="utf-8").read()
    table = doc[doc.index(BEGIN) + len(BEGIN):doc.index(END)].strip("\n") + "\n"
    assert table == render_table([verdicts[r.name] for r in SEED_RECIPES]), f"stale: run {REGENERATE}"
