"""Where each feature runs: the placement x feature table of ``docs/cluster.md``, generated.

    python -m posttrain.config.placement_table            # print the table
    python -m posttrain.config.placement_table --write    # rewrite it in docs/cluster.md

A cell is a config: the tiny config of the feature's stage (``configs/*_tiny_*.yaml``) with the
feature's and the placement's overrides (:data:`FEATURES`, :data:`PLACEMENTS`), put through the one
config check (:func:`posttrain.config.check.collect_checks`) on a CPU and on CUDA, planned for its
target (``here=False``: this machine's packages do not matter). It says:

* **refused**: the check's first message (on both devices, or on the one named);
* **tested**: the test that runs it (:data:`TESTED`, checked to exist by
  ``tests/unit/config/test_placement_table.py``, which also fails when a tested cell is refused on
  a CPU, where the tests run); a tested cell that only CUDA refuses names that refusal too;
* **runs, untested**: accepted, and no test runs that combination yet.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from posttrain.config.check import Refusals, collect_checks
from posttrain.config.run import load_run_config
from posttrain.errors import ConfigError
from posttrain.models.arch import ModelArch
from posttrain.paths import PROJECT_ROOT

DOC_PATH = PROJECT_ROOT / "docs" / "cluster.md"
BEGIN = "<!-- placement-table: begin (python -m posttrain.config.placement_table --write) -->"
END = "<!-- placement-table: end -->"

# 2 workers; micro-batches of 4 rows, so that the tiny configs' batches share over 2 data-parallel workers
RAY2 = ("rl_config.actor_resource.num_npus=2", "megatron_training.micro_batch_size=4", "actor_config.micro_batch_size=4")
# the seed's rule 2 on a device with bf16 (a CUDA GPU): bf16 training and rollout
CUDA = ("megatron_training.bf16=true", "generate_config.dtype=bfloat16")


@dataclass(frozen=True)
class Placement:
    title: str
    overrides: tuple[str, ...]
    num_nodes: int = 1
    by_feature: tuple[tuple[str, tuple[str, ...]], ...] = ()  # extra overrides for one feature's cell

    def for_feature(self, feature: str) -> tuple[str, ...]:
        return self.overrides + dict(self.by_feature).get(feature, ())


_REWARD_MODEL = ("+reward_config.tokenizer_name_or_path=runs/tiny/reward_model",
                 "+reward_config.load=runs/tiny/reward_model")
_SEPARATE_REFERENCE = ("rl_config.reference_resource.num_npus=1", "rl_config.init_kl_coef=0.01")
_SEPARATE_REWARD = ("rl_config.reward_resource.num_npus=1", *_REWARD_MODEL)
PLACEMENTS: dict[str, Placement] = {
    "process": Placement("one process", ()),
    "ray-ddp": Placement("Ray DDP", RAY2),
    "ray-fsdp2": Placement("Ray FSDP2", (*RAY2, "rl_config.ray_sharding=fsdp2")),
    "megatron": Placement("megatron TP/PP", (*RAY2, "megatron_training.backend=megatron",
                                             "megatron_training.tensor_model_parallel_size=2")),
    # each stage's role of its own: the reference (GRPO), the critic (PPO), the reward model (DAPO, which has no reference)
    "separated": Placement("separated roles", (*RAY2, "rl_config.use_integrated_worker=false"),
                           by_feature=tuple((feature, _SEPARATE_REFERENCE) for feature in
                                          ("grpo", "lora", "async", "partial", "reward-model", "vllm")) + (
                               ("ppo", ("rl_config.critic_resource.num_npus=1", "critic_config.save=runs/tiny/critic")),
                               ("dapo", _SEPARATE_REWARD), ("multi-turn", _SEPARATE_REWARD),
                               ("dpo", _SEPARATE_REFERENCE), ("sft", _SEPARATE_REFERENCE))),
    "multi-node": Placement("multi-node", (*RAY2, "rl_config.ray_address=127.0.0.1:6379"), num_nodes=2),
}


@dataclass(frozen=True)
class Feature:
    title: str
    config: str  # configs/<config>.yaml
    overrides: tuple[str, ...] = ()


FEATURES: dict[str, Feature] = {
    "grpo": Feature("GRPO", "grpo_tiny_qwen2"),
    "dapo": Feature("DAPO", "dapo_tiny_qwen2"),
    "ppo": Feature("PPO", "ppo_tiny_qwen2", ("critic_config.micro_batch_size=4",)),
    "dpo": Feature("DPO", "dpo_tiny_qwen2"),
    "sft": Feature("SFT", "sft_tiny_qwen2"),
    "lora": Feature("LoRA", "grpo_tiny_qwen2", ("actor_config.lora_target_modules=[q_proj,v_proj]",
                                                 "actor_config.lora_r=4", "actor_config.lora_alpha=8")),
    "multi-turn": Feature("multi-turn", "dapo_tiny_multi_turn"),
    "async": Feature("async", "grpo_tiny_qwen2", ("rl_config.async_staleness=1",)),
    "partial": Feature("partial", "grpo_tiny_qwen2", ("rl_config.partial_rollout_max_split=2",)),
    "reward-model": Feature("reward model", "grpo_tiny_qwen2", _REWARD_MODEL),
    "vllm": Feature("vLLM", "grpo_tiny_qwen2", ("rl_config.rollout_engine=vllm",)),
    # images reach the native engine only (rollout_engine: vllm with images is refused: mm-engine); a frozen
    # tower (FSDP2 and the megatron backend train the language model alone: mm-fsdp2-tower, mm-megatron-tower)
    "multimodal": Feature("multimodal", "grpo_tiny_qwen2", ("rl_config.is_multimodal=true",
                                                             "rl_config.freeze_vision_tower=true",
                                                             "rl_config.eval_data_path=null",
                                                             "rl_config.rollout_engine=native")),
}

_C, _E, _V, _M = "tests/cluster/", "tests/e2e/", "tests/vllm/", "tests/integration/"
# (placement, feature) -> the test that runs it ("file::test")
TESTED: dict[tuple[str, str], str] = {
    ("process", "grpo"): _M + "test_grpo_loop.py::test_resume_repeats_the_uninterrupted_run",
    ("process", "dapo"): _E + "test_e2e_algorithms.py::test_dapo_dynamic_sampling_reports_num_gen_batches",
    ("process", "ppo"): _E + "test_e2e_algorithms.py::test_ppo_raises_reward_and_saves_the_critic",
    ("process", "dpo"): _E + "test_e2e_algorithms.py::test_dpo_raises_accuracy_and_margin",
    ("process", "sft"): _E + "test_e2e_tiny_pipeline.py::test_tiny_pipeline_learns",
    ("process", "lora"): _M + "test_lora_loop.py::test_a_lora_run_resumes_exactly",
    ("process", "multi-turn"): _E + "test_e2e_tool_use.py::test_dapo_with_the_code_tool_learns_over_its_warm_start",
    ("process", "async"): _M + "test_async_loop.py::test_staleness_one_trains_on_samples_one_version_old",
    ("process", "partial"): _M + "test_async_loop.py::test_partial_rollout_resumes_exactly_and_no_sample_outlives_the_split",
    ("process", "reward-model"): _M + "test_reward_model_loop.py::test_grpo_raises_the_reward_model_score",
    ("process", "vllm"): _V + "test_vllm_loop.py::test_every_rollout_samples_from_the_trained_weights",
    ("ray-ddp", "grpo"): _C + "test_ray_grpo.py::test_a_whole_run_on_two_workers_equals_the_run_in_one_process[grpo]",
    ("ray-ddp", "dapo"): _C + "test_ray_grpo.py::test_a_whole_run_on_two_workers_equals_the_run_in_one_process[dapo]",
    ("ray-ddp", "sft"): _C + "test_ray_offline.py::test_two_workers_equal_one_process_and_their_checkpoint_resumes_in_one"
                             "[sft-ddp]",
    ("ray-fsdp2", "grpo"): _C + "test_ray_grpo.py::test_two_workers_update_equals_one_process_on_the_same_batch[fsdp2]",
    ("ray-fsdp2", "dpo"): _C + "test_ray_offline.py::test_two_workers_equal_one_process_and_their_checkpoint_resumes_in_one"
                               "[dpo-fsdp2]",
    ("ray-ddp", "ppo"): _C + "test_ray_grpo.py::test_a_whole_run_on_two_workers_equals_the_run_in_one_process[ppo]",
    ("ray-ddp", "lora"): _C + "test_ray_lora.py::test_lora_on_two_workers_equals_one_process[ddp]",
    ("ray-ddp", "multi-turn"): _C + "test_ray_multi_turn.py::test_multi_turn_on_two_workers_equals_one_process",
    ("ray-ddp", "reward-model"): _C + "test_ray_reward_model.py::test_two_workers_score_like_one_process",
    ("ray-ddp", "vllm"): _V + "test_vllm_ray.py::test_the_run_on_two_workers_equals_the_run_in_one_process",
    ("ray-fsdp2", "lora"): _C + "test_ray_lora.py::test_lora_on_two_workers_equals_one_process[fsdp2]",
    ("ray-fsdp2", "vllm"): _V + "test_vllm_ray.py::test_lora_on_fsdp2_shards_pushes_the_merged_weights",
    ("megatron", "grpo"): _C + "test_ray_megatron.py::test_grpo_on_the_megatron_backend_equals_the_hf_backend",
    ("megatron", "dapo"): _C + "test_ray_megatron.py::test_dapo_on_the_megatron_backend_equals_the_hf_backend",
    ("megatron", "ppo"): _C + "test_ray_megatron.py::test_ppo_on_the_megatron_backend_equals_the_hf_backend",
    ("megatron", "dpo"): _C + "test_ray_megatron.py::test_offline_stages_on_the_megatron_backend_equal_the_hf_backend"
                              "[dpo-1-2-1]",
    ("megatron", "sft"): _C + "test_ray_megatron.py::test_offline_stages_on_the_megatron_backend_equal_the_hf_backend"
                              "[sft-2-1-1]",
    ("megatron", "lora"): _C + "test_ray_megatron_lora.py::test_lora_on_the_megatron_backend_equals_the_hf_backend",
    ("ray-ddp", "partial"): _C + "test_ray_grpo.py::test_partial_and_async_rollout_on_two_workers_equal_the_run_in_one_process",
    ("ray-ddp", "async"): _C + "test_ray_grpo.py::test_partial_and_async_rollout_on_two_workers_equal_the_run_in_one_process",
    # async with the vLLM engine (the engine a CUDA run picks): each worker's engine loads the pipeline's version
    ("ray-fsdp2", "async"): _V + "test_vllm_ray.py::test_async_staleness_on_two_workers_equals_the_async_run_in_one_process",
    ("megatron", "partial"): _C + "test_ray_megatron.py::"
                                  "test_partial_and_async_rollout_on_the_megatron_backend_equal_the_hf_backend_and_resume",
    ("megatron", "async"): _C + "test_ray_megatron.py::"
                                "test_partial_and_async_rollout_on_the_megatron_backend_equal_the_hf_backend_and_resume",
    ("megatron", "reward-model"): _C + "test_ray_megatron_roles.py::"
                                       "test_multi_turn_and_a_reward_model_on_the_megatron_backend_equal_the_hf_backend",
    ("megatron", "multi-turn"): _C + "test_ray_megatron_roles.py::"
                                     "test_multi_turn_and_a_reward_model_on_the_megatron_backend_equal_the_hf_backend",
    ("megatron", "vllm"): _V + "test_vllm_megatron.py::test_megatron_with_vllm_equals_the_hf_backend_with_vllm",
    ("separated", "ppo"): _C + "test_separated_roles.py::test_separated_roles_equal_the_integrated_run_blocking_or_not",
    ("separated", "async"): _C + "test_separated_roles.py::"
                                 "test_partial_or_async_rollout_with_separated_roles_equals_the_integrated_run[async]",
    ("separated", "partial"): _C + "test_separated_roles.py::"
                                   "test_partial_or_async_rollout_with_separated_roles_equals_the_integrated_run[partial]",
    ("multi-node", "grpo"): _C + "test_multi_node.py::test_grpo_with_its_workers_on_two_nodes_equals_the_run_in_one_process",
    ("process", "multimodal"): _E + "test_e2e_multimodal.py::test_a_resumed_run_repeats_the_straight_one",
    ("ray-ddp", "multimodal"): _C + "test_ray_multimodal.py::test_two_workers_equal_one_process",
    ("ray-fsdp2", "multimodal"): _C + "test_ray_multimodal.py::test_fsdp2_with_a_frozen_tower_on_two_workers_equals_one_process",
    ("megatron", "multimodal"): _C + "test_ray_megatron_multimodal.py::test_grpo_with_images_on_the_megatron_backend",
}
# the megatron backend across nodes is a multi-node test too (its own placement column is megatron's)
MULTI_NODE_MEGATRON = _C + "test_multi_node.py::test_megatron_tensor_parallel_across_two_nodes_trains_and_resumes"

# a tiny architecture for the megatron backend's layout checks (the tiny configs' model is built by the tests)
TINY_ARCH = ModelArch(model_type="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=128, tie_embeddings=True)


def refusal(placement: str, feature: str, device: str) -> str | None:
    """The first message of the one config check for the cell on ``device``, or None if accepted."""
    place, feat = PLACEMENTS[placement], FEATURES[feature]
    try:
        overrides = [*feat.overrides, *place.for_feature(feature), *(CUDA if device == "cuda" else ())]
        cfg = load_run_config(feat.config, overrides=overrides)
    except ConfigError as err:
        return str(err).splitlines()[0]
    refusals = Refusals()
    collect_checks(cfg, refusals, device_type=device, arch=TINY_ARCH, num_nodes=place.num_nodes, here=False)
    return refusals.messages[0] if refusals.messages else None


def cell(placement: str, feature: str) -> tuple[str, str, str]:
    """(``"tested"`` | ``"refused"`` | ``"untested"``, the test or the reason, and for a tested cell
    that CUDA refuses, CUDA's reason: the tests run on a CPU)."""
    cpu, cuda = refusal(placement, feature, "cpu"), refusal(placement, feature, "cuda")
    test = TESTED.get((placement, feature))
    if cpu and cuda:
        return "refused", cpu, ""
    if cpu or (cuda and not test):
        return "refused", f"on {'a CPU' if cpu else 'CUDA'}: {cpu or cuda}", ""
    cuda_note = f"on CUDA: {cuda}" if cuda else ""
    return ("tested", test, cuda_note) if test else ("untested", "", "")


def render() -> str:
    """The table (placements as columns), then the refusal reasons as numbered notes."""
    head = ["feature", *(p.title for p in PLACEMENTS.values())]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: list[str] = []
    for name, feature in FEATURES.items():
        row = [feature.title]
        for placement in PLACEMENTS:
            verdict, detail, cuda_note = cell(placement, name)
            for note in (detail if verdict == "refused" else "", cuda_note):
                if note and note not in notes:
                    notes.append(note)
            if verdict == "tested":
                on_cuda = f" (on CUDA refused [{notes.index(cuda_note) + 1}])" if cuda_note else ""
                row.append(f"tested: `{detail.rsplit('/', 1)[1]}`{on_cuda}")
            elif verdict == "refused":
                row.append(f"refused [{notes.index(detail) + 1}]")
            else:
                row.append("runs, untested")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"Megatron across nodes: `{MULTI_NODE_MEGATRON.rsplit('/', 1)[1]}`.", "",
              "Refused because:", "", *(f"{i}. {note.replace('|', '/')}" for i, note in enumerate(notes, 1))]
    return "\n".join(lines)


def current_doc() -> str:
    text = DOC_PATH.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")


def write_doc() -> None:
    text = DOC_PATH.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC_PATH.write_text(text[:start] + "\n" + render() + "\n" + text[stop:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC_PATH}")
    args = parser.parse_args(argv)
    if args.write:
        write_doc()
    else:
        print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
