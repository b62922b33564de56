"""Every key docs/metrics.md lists (from "Every key" on) is logged: three tiny runs of one or two
iterations (GRPO asynchronous with partial rollout, an offloaded reference and a held-out set; PPO with
the KL in the reward and speculative decoding; DAPO with dynamic sampling) log them all, except the keys of :data:`ELSEWHERE`, each asserted by the test named
there, and the GPU-only vLLM sleep; and every key those runs log is in the doc."""

from __future__ import annotations

import json
import re

import pytest

from posttrain.paths import PROJECT_ROOT
from tests.integration.test_grpo_loop import grpo_config

pytestmark = pytest.mark.slow
DOC = PROJECT_ROOT / "docs" / "metrics.md"
# keys other runs log, with the test that asserts them (checked to name the key)
ELSEWHERE = {
    "timing/reward_model": "tests/integration/test_reward_model_loop.py",
    "reward_model/score/mean": "tests/integration/test_reward_model_loop.py",
    "reward_model/score/max": "tests/integration/test_reward_model_loop.py",
    "reward_model/score/min": "tests/integration/test_reward_model_loop.py",
    "timing/non_overlap_reward_model": "tests/unit/metrics/test_metrics.py",  # a reward model beside a reference
    "timing/tool": "tests/e2e/test_e2e_tool_use.py",
    "tool_call_num/mean": "tests/e2e/test_e2e_tool_use.py",
    "tool_call_num/max": "tests/e2e/test_e2e_tool_use.py",
    "tool_call_num/min": "tests/e2e/test_e2e_tool_use.py",
    "rollout/sync_probe_diff": "tests/vllm/test_vllm_loop.py",
    "env/turns/mean": "tests/unit/envs/test_openenv_local.py",  # rl_config.env_config.type: openenv
    "env/done/mean": "tests/unit/envs/test_openenv_local.py",
}
GPU_ONLY = {"timing/resharding_to_train"}  # vLLM's sleep: no sleep mode on a CPU (the doc says so)


def documented() -> list[str]:
    """The keys (or patterns, with ``.+``) in the first column of the tables under "## Every key"."""
    text = DOC.read_text()
    section = text[text.index("## Every key"):]  # its tables, and those of the off-policy and speculation keys
    keys = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for token in re.findall(r"`([^`]+)`", first):
            alternatives = re.match(r"(.*)\{([a-z0-9@,]+)\}(.*)$", token)
            if alternatives and "," in alternatives.group(2):
                keys += [alternatives.group(1) + part + alternatives.group(3) for part in alternatives.group(2).split(",")]
            else:
                keys.append(token.replace("{verifier}", "[a-z0-9_]+").replace("…", "(mean|max|min)"))
    return keys


@pytest.fixture(scope="module")
def logged(mini_qwen2_dir, tiny_prompt_data, tmp_path_factory) -> set[str]:
    from posttrain.commands.train import train_config as train

    root = tmp_path_factory.mktemp("metric_keys")
    runs = {
        "grpo": dict(rl_config__async_staleness=1, rl_config__partial_rollout_max_split=2,
                     rl_config__offload_reference=True, rl_config__epochs=2,
                     rl_config__eval_data_path=tiny_prompt_data, rl_config__eval_limit=4,
                     megatron_training__train_iters=2),
        "ppo": dict(megatron_training__stage="ray_ppo", rl_config__adv_estimator="gae", rl_config__use_kl_in_reward=True,
                    generate_config__num_speculative_tokens=2, megatron_training__train_iters=1),
        "dapo": dict(megatron_training__stage="ray_dapo", rl_config__filter_groups_enable=True,
                     rl_config__filter_groups_metric="test_digit_share", rl_config__filter_groups_train_batch_size=2,
                     rl_config__filter_groups_max_batches=0,
                     rl_config__init_kl_coef=0.0, megatron_training__train_iters=1),
    }
    keys: set[str] = set()
    for name, over in runs.items():
        out = root / name
        train(grpo_config(mini_qwen2_dir, tiny_prompt_data, out, megatron_training__save=None, **over))
        for file in ("metrics.jsonl", "eval.jsonl"):
            if (out / "run" / file).is_file():
                for line in (out / "run" / file).read_text().splitlines():
                    keys |= set(json.loads(line)) - {"iteration", "time"}
    return keys


def test_every_documented_key_is_logged(logged):
    missing = []
    for key in documented():
        if key in GPU_ONLY:
            continue
        if key in ELSEWHERE:  # the test that logs it names it
            source = (PROJECT_ROOT / ELSEWHERE[key]).read_text()
            assert key in source or (key.endswith(("/max", "/min")) and key.rsplit("/", 1)[0] + "/{" in source), \
                (key, ELSEWHERE[key])
            continue
        if not any(re.fullmatch(key, k) for k in logged):
            missing.append(key)
    assert not missing, f"docs/metrics.md lists keys no run logged: {missing}"


def test_every_logged_key_is_documented(logged):
    patterns = documented()
    undocumented = sorted(k for k in logged if not any(re.fullmatch(p, k) for p in patterns))
    assert not undocumented, f"logged but not in docs/metrics.md's 'Every key': {undocumented}"
