"""The reward-model role: where reward_config.load may point (HF, posttrain checkpoints, Megatron --orm)
and the models it refuses (no trained head, another vocabulary)."""

from __future__ import annotations

import shutil

import pytest
import torch

from posttrain.config.reward_model import RewardModelOptions
from posttrain.errors import CheckpointError, ConfigError
from posttrain.roles.reward_model import build_reward_scorer


class _Tok:
    """The actor's tokenizer as the scorer sees it: a length, a vocabulary and a pad id."""

    def __init__(self, size: int):
        self.size, self.pad_token_id, self.eos_token_id = size, 0, 1

    def __len__(self):
        return self.size

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.size)}


def options(path, batch=2) -> RewardModelOptions:
    return RewardModelOptions(path=str(path), dtype="float32", micro_batch_size=batch, weight=1.0)


PROMPTS, RESPONSES = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]]


def test_hf_posttrain_and_megatron_orm_checkpoints_score_alike(tiny_hf, tmp_path, monkeypatch):
    from posttrain.cli import main

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf("qwen2_rm")
    want = build_reward_scorer(options(hf), _Tok(100), "cpu").score_sequences(PROMPTS, RESPONSES)
    assert len(set(want)) == 2
    # a posttrain PPO checkpoint: the critic/ of its newest iter_*
    ckpt = tmp_path / "ppo" / "iter_0000003"
    shutil.copytree(hf, ckpt / "critic")
    (ckpt / "config.json").write_text("{}")  # the actor's (a causal LM), not the reward model
    (tmp_path / "ppo" / "latest_checkpointed_iteration.txt").write_text("3")
    (ckpt / "trainer_state.json").write_text('{"iteration": 3}')
    assert main(["convert", "--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf),
                 "--save-dir", str(tmp_path / "mg"), "--target-tensor-parallel-size", "2",
                 "--target-pipeline-parallel-size", "2", "--orm"]) == 0
    for path in (ckpt, tmp_path / "mg"):
        got = build_reward_scorer(options(path), _Tok(100), "cpu").score_sequences(PROMPTS, RESPONSES)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_a_model_without_a_trained_head_or_with_another_vocabulary_is_refused(tiny_hf, mini_qwen2_dir, tmp_path):
    with pytest.raises(CheckpointError, match="has no trained score head"):
        build_reward_scorer(options(tiny_hf("qwen2")), _Tok(100), "cpu")  # a causal LM
    with pytest.raises(ConfigError, match="the actor's tokenizer has 101 tokens but the reward model .* embeds "
                                          "only 100"):
        build_reward_scorer(options(tiny_hf("qwen2_rm")), _Tok(101), "cpu")
    rm = tmp_path / "rm_other_tokenizer"
    shutil.copytree(tiny_hf("qwen2_rm"), rm)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (mini_qwen2_dir / name).is_file():
            shutil.copy(mini_qwen2_dir / name, rm / name)
    with pytest.raises(ConfigError, match="differs from the actor's"):
        build_reward_scorer(options(rm), _Tok(100), "cpu")
    with pytest.raises(ConfigError, match="reward_config.load: .* does not exist"):
        build_reward_scorer(options(tmp_path / "missing"), _Tok(100), "cpu")
