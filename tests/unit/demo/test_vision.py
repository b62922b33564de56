"""The vision demo (posttrain.demo.vision*): the shape-counting task's splits, pictures and rewards, and
a 1-iteration smoke of every stage at a toy size (no learning is measured here: docs/demo.md has the
measured runs)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from posttrain.demo.vision_task import (MAX_COUNT, lenient_reward, make_vision_splits, strict_reward,
                                        write_vision_data)
from posttrain.errors import ConfigError


def count_components(path) -> int:
    """The number of 4-connected regions of non-white pixels in the picture at ``path`` (a flood fill
    written here, independent of how the generator places its shapes)."""
    ink = np.asarray(Image.open(path).convert("RGB")).min(axis=2) < 250
    seen = np.zeros_like(ink)
    regions = 0
    for start in zip(*np.nonzero(ink)):
        if seen[start]:
            continue
        regions += 1
        stack = [start]
        seen[start] = True
        while stack:
            y, x = stack.pop()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < ink.shape[0] and 0 <= nx < ink.shape[1] and ink[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return regions


def test_splits_are_deterministic_disjoint_and_balanced():
    train, test = make_vision_splits(60, 24, seed=3)
    assert (train, test) == make_vision_splits(60, 24, seed=3)
    assert make_vision_splits(60, 24, seed=4)[1] != test
    assert len(set(train)) == 60 and len(set(test)) == 24 and not set(train) & set(test)
    assert Counter(len(layout) for layout in test) == {n: 6 for n in range(1, MAX_COUNT + 1)}
    with pytest.raises(ConfigError, match="num_train"):
        make_vision_splits(0, 4)


def test_the_pictures_decode_and_hold_the_answer_count(tmp_path):
    train_path, test_path = write_vision_data(tmp_path, 16, 8, seed=5)
    rows = [json.loads(line) for path in (train_path, test_path) for line in path.read_text().splitlines()]
    assert len(rows) == 24 and len({r["images"][0] for r in rows}) == 24
    for row in rows:
        assert row["prompt"].count("<image>") == 1 and len(row["images"]) == 1
        image = Image.open(tmp_path / row["images"][0])
        assert image.size == (56, 56)
        assert count_components(tmp_path / row["images"][0]) == int(row["answer"]), row


@pytest.mark.parametrize("reply, strict, lenient", [
    ("\\boxed{3}", 1.0, 1.0), ("I see \\boxed{3}", 1.0, 1.0), ("\\boxed{4}", 0.0, 0.0), ("3", 0.0, 1.0),
    ("The answer is 3.", 0.0, 1.0), ("3 or 4", 0.0, 0.0), ("", 0.0, 0.0)])
def test_strict_and_lenient_rewards_on_hand_examples(reply, strict, lenient):
    assert strict_reward(reply, "3") == strict
    assert lenient_reward(reply, "3") == lenient


def test_every_stage_runs_one_toy_iteration(tmp_path, one_thread):
    from transformers import AutoTokenizer

    from posttrain.data.datasets import PromptDataset
    from posttrain.demo.vision import VisionSettings, run_seed
    from posttrain.demo.vision_sft import chat_prompt
    from posttrain.demo.vision_task import QUESTION

    settings = VisionSettings(num_train=8, num_test=4, sft_max_steps=2, sft_batch_size=4)
    summary = run_seed(tmp_path, 3, settings, iters=1, overrides=(
        "megatron_training.global_batch_size=4", "rl_config.n_samples_per_prompt=2", "rl_config.mini_batch_size=4",
        "actor_config.micro_batch_size=4"))
    rows = [json.loads(line) for line in (tmp_path / "vision_metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and summary["iterations"] == 1
    assert rows[1]["grpo/score/mean"] is not None and summary["sft_steps"] == 2
    for row in rows:  # greedy accuracy of 4 held-out pictures
        assert row["eval/accuracy"] * 4 == int(row["eval/accuracy"] * 4)
    assert (tmp_path / "reward_accuracy.png").stat().st_size > 0
    assert (tmp_path / "ckpt" / "iter_0000001" / "preprocessor_config.json").is_file()
    # the warm start and the evaluation ask exactly the prompt GRPO trains on (the preprocessed one)
    tok = AutoTokenizer.from_pretrained(tmp_path / "model_init")
    prompts = PromptDataset(str(tmp_path / "data" / "train"), max_prompt_length=512, split="100,0,0")
    assert prompts[0]["prompts"].tolist() == tok(chat_prompt(tok, QUESTION))["input_ids"]


def test_the_demo_refuses_flags_of_the_other_task():
    from posttrain.demo.run import main

    with pytest.raises(ConfigError, match="--seeds"):
        main(["--task", "products", "--seeds", "1", "2"])
    with pytest.raises(ConfigError, match="--model"):
        main(["--task", "vision", "--model", "somewhere"])


def test_several_seeds_are_gathered_per_iteration(tmp_path):
    from posttrain.demo.vision import gather_seeds

    summaries = [{"seed": seed, "per_iteration": [
        {"iteration": i, "eval/accuracy": 0.1 * i + seed, "eval/lenient_accuracy": 0.2 * i + seed} for i in (0, 1)]}
        for seed in (1, 2)]
    gather_seeds(tmp_path, summaries)
    rows = [json.loads(line) for line in (tmp_path / "seeds_metrics.jsonl").read_text().splitlines()]
    assert rows[1] == {"iteration": 1, "seed 1: strict": 1.1, "seed 1: lenient": 1.2, "seed 2: strict": 2.1,
                       "seed 2: lenient": 2.2}
