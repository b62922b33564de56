"""Partial rollout and asynchronous rollout with images (rl_config.is_multimodal with
partial_rollout_max_split: 2, async_staleness: 1, or both) on the tiny Qwen2.5-VL, in one process.

The learning rate (1e-20) does not move the policy, so over 2 GRPO iterations every sampled token's
log-prob must be the starting model's, computed by an independent Hugging Face forward of the
sample (prompt + response) with its prompt's picture, read again from the picture file the prompt's
label names:

* the rollout's own log-prob (the native engine's; it never samples the vision tokens, so the
  reference is renormalised without them), for responses cut at an iteration's budget and continued
  with their images in the next one (partial) and for samples drawn by the replica a version behind
  (async), within 1e-4;
* the trainer's old log-prob (the update's samples carry their images), within 1e-4; and the
  update sees the same log-probs (``actor/ppo_kl`` ~ 0).

These log-probs are about -5.6 nats a token on the random model, and a continuation prefilled with
a blank picture in place of its own moves them by 0.05 (the mutation test: the check fails).
The partial runs in rounds (alone, and with async) reuse the image embeddings (a frozen tower); the
others train the tower. A run that dies after saving iteration 1 and resumes learns from the
straight run's samples: the saved pool and in-flight experiences hold the pictures.
"""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image

from posttrain.loops.partial_rollout import PartialRollout
from posttrain.loops.onpolicy import OnPolicyTrainer
from tests.e2e.test_e2e_multimodal import mm_config  # also registers its verifier, test_mm_token_share
from tests.helpers.runs import metrics_by_iteration
from tests.helpers.tiny_vlm import COLOURS, colour_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

# Partial rollout (max_tokens 6, split 2: rounds of 3 tokens) over a pool of 8 groups of 2. Iteration
# 1 has 16 rows to sample, more than max_num_seqs, so the pool runs rounds (one generate each); after
# the first round the text-only samples are complete (MAX_MODEL_LEN) and make the first update, and
# the pictured ones are cut. Iteration 2 continues them with their pictures: in a round (``rounds``:
# prompts 0 and 2 pictured, max_num_seqs 8), or (``decode``: prompt 0 pictured, max_num_seqs 12, so
# the 12 rows left fit one decode) in the one decode that keeps its KV cache.
PARTIAL = {"rl_config__partial_rollout_max_split": 2}
MODES = {"partial-rounds": ("half", {**PARTIAL, "generate_config__max_num_seqs": 8, "rl_config__freeze_vision_tower":
                                     True, "rl_config__reuse_image_embeds": True}),
         "partial-decode": ("one", {**PARTIAL, "generate_config__max_num_seqs": 12}),
         "async": ("half", {"rl_config__async_staleness": 1}),
         "async-partial": ("half", {**PARTIAL, "generate_config__max_num_seqs": 8, "rl_config__async_staleness": 1,
                                    "rl_config__freeze_vision_tower": True, "rl_config__reuse_image_embeds": True})}
PICTURED = {"half": (0, 2), "one": (0,)}  # the pictured prompts of each dataset
CAPTURED = ("prompts", "responses", "labels", "rollout_logprobs", "old_logprobs", "policy_version")


# prompt lengths in tokens (the qwen2_vl template on init-model's tokenizer): "<image> colour?" with the
# picture's 4 image tokens, and the text-only question, 3 tokens longer
PICTURED_LENGTH, TEXT_LENGTH = 68, 71
MAX_MODEL_LEN = TEXT_LENGTH + 3  # a text-only sample is complete after one round (6 // 2 tokens), a pictured one is not


@pytest.fixture(scope="module")
def colour_data(tiny_vlm_dir, tmp_path_factory):
    """The colour pictures of :func:`colour_prompts`, asked about as there ("<image> colour?") in the
    pictured prompts of each dataset of :data:`PICTURED` and by a longer text-only question in the
    others. Returns (the pictures' folder, {dataset: its prefix})."""
    from posttrain.data.preprocess import preprocess
    from tests.helpers.data import write_jsonl

    root = tmp_path_factory.mktemp("mm_modes")
    colour_prompts(root, tiny_vlm_dir)  # the pictures
    prefixes = {}
    for name, pictured in PICTURED.items():
        rows = [{"problem": "<image> colour?" if i in pictured else "what colour is the square", "answer": colour,
                 "images": [f"{i}.png"] if i in pictured else []} for i, colour in enumerate(COLOURS)]
        write_jsonl(root / f"{name}.jsonl", rows)
        preprocess({"input": str(root / f"{name}.jsonl"), "handler_name": "R1AlpacaStyleInstructionHandler",
                    "tokenizer_name_or_path": str(tiny_vlm_dir), "prompt_type": "qwen2_vl",
                    "output_prefix": str(root / name / "modes"), "map_keys": {"prompt": "problem", "response": "answer"},
                    "dataset_additional_keys": ["labels"], "workers": 1}, progress=False)
        prefixes[name] = str(root / name / "modes")
    return root, prefixes


@pytest.fixture(scope="module")
def reference(tiny_vlm_dir, colour_data):
    """``logprobs(sample) -> (full, without vision tokens)``: the starting model's forward of the sample
    with the picture of its label, read from its file by the model directory's processor."""
    from transformers import AutoModelForImageTextToText

    from posttrain.models.vlm import load_processor

    root, _ = colour_data
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    processor = load_processor(tiny_vlm_dir)
    config = model.config
    vision = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]

    def logprobs(sample):
        ids = torch.cat([sample["prompts"], sample["responses"]])[None]
        pictures = {}
        if (ids == config.image_token_id).any():
            colour = processor.tokenizer.decode(sample["labels"].tolist()).strip()
            image = Image.open(root / f"{COLOURS.index(colour)}.png").convert("RGB")
            encoded = processor.image_processor(images=[image], return_tensors="pt")
            pictures = {"pixel_values": encoded["pixel_values"], "image_grid_thw": encoded["image_grid_thw"]}
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=(ids == config.image_token_id).int(), **pictures).logits[0]
        start, length = sample["prompts"].numel(), sample["responses"].numel()
        logits = logits[start - 1:start + length - 1].float()
        token = sample["responses"][:, None]
        masked = logits.clone()
        masked[:, vision] = float("-inf")
        return (torch.log_softmax(logits, -1).gather(-1, token)[:, 0],
                torch.log_softmax(masked, -1).gather(-1, token)[:, 0])

    return logprobs


def run_mode(mode, tiny_vlm_dir, colour_data, out, monkeypatch, blank_continuations=False, **extra):
    """Two learning-free GRPO iterations of ``mode``; returns (metrics by iteration, the samples each
    update learned from, the continued rows' count, the pool's decodes). ``blank_continuations``: the
    mutation, a continued sample is re-prefilled with a blank picture. ``extra``: more config keys."""
    from posttrain.commands.train import train_config as train

    samples, continued, decodes = [], [], []
    real_correct, real_images, real_decode = OnPolicyTrainer.correct, PartialRollout.row_images, PartialRollout.decode

    def correct(self, td, acc, iteration):  # the dock after the old log-prob pass
        samples.extend({c: td.cell(c, r) for c in CAPTURED} for r in range(td.max_len))
        return real_correct(self, td, acc, iteration)

    def row_images(self, rows):
        images = real_images(self, rows)
        for k, r in enumerate(rows):
            if self.dock.cell("responses", r).numel():  # a continued sample: re-prefilled with its images
                continued.append(r)
                if blank_continuations:
                    entry = images["images"][k]
                    images["images"][k] = {**entry, "pixel_values": torch.zeros_like(entry["pixel_values"])}
        return images

    monkeypatch.setattr(OnPolicyTrainer, "correct", correct)
    monkeypatch.setattr(PartialRollout, "row_images", row_images)
    monkeypatch.setattr(PartialRollout, "decode", lambda self, *a: decodes.append(1) or real_decode(self, *a))
    data, over = MODES[mode]
    train(mm_config(tiny_vlm_dir, colour_data[1][data], out, iters=2, megatron_training__lr=1e-20,
                    generate_config__max_model_len=MAX_MODEL_LEN, megatron_training__seq_length=MAX_MODEL_LEN,
                    **over, **extra))
    return metrics_by_iteration(out / "run"), samples, len(continued), len(decodes)


def worst_differences(samples, reference) -> tuple[float, float]:
    """The largest |rollout - reference without vision tokens| and |old - reference| over every token."""
    rollout = old = 0.0
    for sample in samples:
        full, masked = reference(sample)
        rollout = max(rollout, (sample["rollout_logprobs"] - masked).abs().max().item())
        old = max(old, (sample["old_logprobs"] - full).abs().max().item())
    return rollout, old


@pytest.fixture(scope="module")
def mode_runs(tiny_vlm_dir, colour_data, tmp_path_factory):
    """``run(mode)``: :func:`run_mode`'s result, each mode run once for the module."""
    done = {}

    def run(mode):
        if mode not in done:
            with pytest.MonkeyPatch.context() as monkeypatch:
                done[mode] = run_mode(mode, tiny_vlm_dir, colour_data, tmp_path_factory.mktemp(mode), monkeypatch)
        return done[mode]

    return run


@pytest.mark.parametrize("mode", MODES)
def test_images_reach_every_pass(mode, mode_runs, reference):
    metrics, samples, continued, decodes = mode_runs(mode)
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "grpo/score/mean", "response_length/mean"):
            assert math.isfinite(row[key]), (key, row[key])
        assert abs(row["actor/ppo_kl"]) < 1e-6, row  # the update's log-probs are the old ones
    assert len(samples) == 16  # 4 prompts x 2 samples, 2 iterations
    assert {s["prompts"].numel() for s in samples} <= {PICTURED_LENGTH, TEXT_LENGTH}
    pictured = [s for s in samples if s["prompts"].numel() == PICTURED_LENGTH]
    assert pictured and max(s["responses"].numel() for s in pictured) == 6
    if "partial" in mode:  # iteration 2 learns from the pictured samples cut in 1, continued with their images
        assert continued == 4 * len(PICTURED[MODES[mode][0]])  # both batches' pictured groups of 2 rows
        assert [s for s in samples[:8] if s["prompts"].numel() == PICTURED_LENGTH] == []
        assert sum(s["prompts"].numel() == PICTURED_LENGTH for s in samples[8:]) == continued
        assert all(int(s["policy_version"]) == 0 for s in samples[8:])
        assert metrics[2]["rollout/staleness_max"] == 1
        assert decodes == (1 if mode == "partial-decode" else 0)
    if "async" in mode:  # iteration 2's samples were drawn by the replica still holding version 0
        assert metrics[2]["rollout/staleness_max"] == 1
        assert all(int(s["policy_version"]) == 0 for s in samples[8:])
    rollout, old = worst_differences(samples, reference)
    assert rollout < 1e-4 and old < 1e-4, (rollout, old)
    assert min(s["rollout_logprobs"].mean().item() for s in samples if s["responses"].numel()) < -1.0  # not ~0


@pytest.mark.parametrize("mode", ["partial-rounds", "partial-decode"])
def test_a_continuation_without_its_picture_fails_the_check(mode, tiny_vlm_dir, colour_data, reference, tmp_path,
                                                            monkeypatch):
    metrics, samples, continued, _ = run_mode(mode, tiny_vlm_dir, colour_data, tmp_path, monkeypatch,
                                              blank_continuations=True)
    assert continued == 4 * len(PICTURED[MODES[mode][0]]) and sorted(metrics) == [1, 2]
    rollout, old = worst_differences(samples, reference)
    assert old < 1e-4  # the trainer's passes still read the dock's pictures
    assert rollout > 1e-2, rollout  # the continued tokens were sampled without the picture


class Killed(Exception):
    """The run dies here (as under a kill): nothing after it runs."""


@pytest.mark.parametrize("mode", ["partial-rounds", "async"])
def test_a_resumed_run_learns_from_the_straight_runs_samples(mode, mode_runs, tiny_vlm_dir, colour_data, tmp_path,
                                                              monkeypatch):
    """The checkpoint of iteration 1 holds the pictures of the samples not trained on yet: the partial
    pool's cut samples (``partial_rollout.pt``), continued by the resumed run, or the asynchronous
    run's finished iteration 2 (``in_flight.pt``); the resumed iteration 2 learns from the straight
    run's samples, its old log-probs read with their pictures."""
    _, straight, _, _ = mode_runs(mode)
    real = OnPolicyTrainer.train_step

    def dies_at_iteration_2(self, iteration):
        if iteration == 2:
            raise Killed
        return real(self, iteration)

    with monkeypatch.context() as dying:
        dying.setattr(OnPolicyTrainer, "train_step", dies_at_iteration_2)
        with pytest.raises(Killed):  # the run dies after saving iteration 1
            run_mode(mode, tiny_vlm_dir, colour_data, tmp_path, dying)
    saved = torch.load(tmp_path / "ckpt" / "iter_0000001" / ("partial_rollout.pt" if "partial" in mode
                                                             else "in_flight.pt"), weights_only=True)
    cells = saved["data"] if "partial" in mode else saved[2]["dock"]["data"]
    pictured = 8 if "partial" in mode else 4  # the cut samples of 4 pictured groups; iteration 2's 2 pictured groups
    assert sum(cell is not None and cell.shape[0] > 0 for cell in cells["pixel_values"]) == pictured
    metrics, resumed, continued, _ = run_mode(mode, tiny_vlm_dir, colour_data, tmp_path, monkeypatch,
                                              actor_config__load=str(tmp_path / "ckpt"))
    assert sorted(metrics) == [1, 2] and len(resumed) == 8
    assert continued == (8 if "partial" in mode else 0)
    for a, b in zip(straight[8:], resumed):
        assert torch.equal(a["prompts"], b["prompts"]) and torch.equal(a["responses"], b["responses"])
        for column in ("rollout_logprobs", "old_logprobs"):
            torch.testing.assert_close(a[column], b[column], rtol=0, atol=1e-6)
