"""The multimodal GRPO loop (rl_config.is_multimodal) on the tiny Qwen2.5-VL of ``posttrain init-model``
(and its tiny Qwen3-VL), in one process on the hf backend: 4 prompts x 2 samples, one 56x56 image each
(4 image tokens).

* GRPO trains (Qwen2.5-VL and Qwen3-VL): finite metrics, the language model and the vision tower
  (Qwen3-VL: its deepstack merger too) change; the saved checkpoint loads with
  ``AutoModelForImageTextToText`` and ``load_processor``; a run that dies after saving
  iteration 1, resumed from its checkpoint, repeats the straight run's iteration 2 and weights.
* The update's log-probs (packed rows, micro-batches of 3 with the images of their rows) equal a
  per-sample Hugging Face forward of the same model with the same images (fp32, 1e-5).
* DAPO (dynamic sampling, the vision tower frozen: it stays as it was) and LoRA (frozen tower, reused
  image embeddings, one image per tower forward; the adapter loads with PEFT and resumes) run an
  iteration; LoRA on Qwen3-VL too (its reused embeddings carry the deepstack features).
* A multimodal dataset needs its images and honours limit_mm_image_per_prompt.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from posttrain.reward.verifiers import register_verifier
from tests.helpers.configs import OMIT, run_config
from tests.helpers.runs import metrics_by_iteration
from tests.helpers.tiny_vlm import colour_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@register_verifier("test_mm_token_share", overwrite=True)
def token_share(response: str, label: str, **_) -> float:
    """Dense and deterministic: the share of the response's characters that are letters of the label."""
    return sum(c in label for c in response) / max(len(response), 1)


@pytest.fixture(scope="module")
def mm_data(tiny_vlm_dir, tmp_path_factory):
    """4 prompts "<image> what colour?", each with a 56x56 picture of one coloured square."""
    return colour_prompts(tmp_path_factory.mktemp("mm"), tiny_vlm_dir)


def mm_config(model_dir, data, out, iters=2, **over):
    """The multimodal GRPO run: 4 prompts x 2 samples a iteration, 6 new tokens, checkpoints every iteration."""
    sections = {"megatron_training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 256, "lr": 1e-3,
                                      "seed": 5, "bf16": OMIT, "prompt_type": "qwen2_vl", "save": str(out / "ckpt"),
                                      "save_interval": 1, "train_iters": iters},
                "rl_config": {"n_samples_per_prompt": 2, "verifier_function": ["test_mm_token_share"],
                              "verifier_modules": OMIT, "verifier_parallel": 0, "init_kl_coef": 0.01,
                              "max_prompt_length": 160, "kl_penalty": "low_var_kl", "device": OMIT,
                              "is_multimodal": True, "mini_batch_size": 2},
                "generate_config": {"max_num_seqs": 16, "limit_mm_image_per_prompt": 1, "max_model_len": 256,
                                    "sampling_config": {"max_tokens": 6, "temperature": 1.0, "top_k": -1}},
                "actor_config": {}}
    for key, value in over.items():
        section, name = key.split("__")
        sections.setdefault(section, {})[name] = value
    return run_config(model_dir, data, out / "run", name="mm_test", **sections)


@pytest.fixture(scope="module")
def straight(tiny_vlm_dir, mm_data, tmp_path_factory):
    """The reference run: 2 GRPO iterations (2 mini-batches each, so old log-probs are computed)."""
    from posttrain.commands.train import train_config as train

    out = tmp_path_factory.mktemp("straight")
    train(mm_config(tiny_vlm_dir, mm_data, out))
    return out


# Qwen3-VL's runs: one image per vision-tower forward; seed 2, whose first iteration's rewards are not all 0
QWEN3 = {"rl_config__vit_forward_micro_batch_size": 1, "megatron_training__seed": 2}


@pytest.fixture(scope="module")
def straight_qwen3(tiny_qwen3_vl_dir, tiny_vlm_dir, mm_data, tmp_path_factory):
    """The same 2 GRPO iterations on the tiny Qwen3-VL (deepstack on vision block 0), one image per
    vision-tower forward. The data's token ids are its own too: init-model gives both the same tokenizer."""
    from posttrain.commands.train import train_config as train

    assert (tiny_qwen3_vl_dir / "tokenizer.json").read_bytes() == (tiny_vlm_dir / "tokenizer.json").read_bytes()
    out = tmp_path_factory.mktemp("straight_qwen3")
    train(mm_config(tiny_qwen3_vl_dir, mm_data, out, **QWEN3))
    return out


@pytest.mark.parametrize("model_dir,run,cls", [("tiny_vlm_dir", "straight", "Qwen2_5_VLForConditionalGeneration"),
                                               ("tiny_qwen3_vl_dir", "straight_qwen3",
                                                "Qwen3VLForConditionalGeneration")], ids=["qwen2_5_vl", "qwen3_vl"])
def test_grpo_trains_the_vlm_and_saves_a_loadable_checkpoint(request, model_dir, run, cls):
    from transformers import AutoModelForImageTextToText

    from posttrain.models.vlm import load_processor

    tiny_vlm_dir, straight = request.getfixturevalue(model_dir), request.getfixturevalue(run)
    metrics = metrics_by_iteration(straight / "run")
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "grpo/score/mean", "response_length/mean"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["prompt_length/mean"] > 4  # the image pad expanded to the picture's 4 tokens
    ckpt = straight / "ckpt" / "iter_0000002"
    assert (ckpt / "preprocessor_config.json").is_file()
    loaded = AutoModelForImageTextToText.from_pretrained(ckpt)
    assert type(loaded).__name__ == cls
    after = loaded.state_dict()
    before = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any(".visual." in k or k.startswith("model.visual") for k in changed)  # the tower learns too
    assert any("language_model" in k for k in changed)
    if cls.startswith("Qwen3"):  # the deepstack merger gets its gradient through the first decoder layer
        assert any("deepstack_merger" in k for k in changed)
    processor = load_processor(ckpt)
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|> hi"], images=[Image.new("RGB", (56, 56))])
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


class Killed(Exception):
    """The run dies here (as under a kill): nothing after it runs."""


@pytest.mark.parametrize("model_dir,run,over", [("tiny_vlm_dir", "straight", {}),
                                                ("tiny_qwen3_vl_dir", "straight_qwen3",
                                                 QWEN3)],
                         ids=["qwen2_5_vl", "qwen3_vl"])
def test_a_resumed_run_repeats_the_straight_one(request, mm_data, tmp_path, monkeypatch, model_dir, run, over):
    from posttrain.commands.train import train_config as train
    from posttrain.loops.onpolicy import OnPolicyTrainer

    tiny_vlm_dir, straight = request.getfixturevalue(model_dir), request.getfixturevalue(run)

    real = OnPolicyTrainer.train_step

    def dies_at_iteration_2(self, iteration):
        if iteration == 2:
            raise Killed
        return real(self, iteration)

    first = tmp_path / "resumed"
    monkeypatch.setattr(OnPolicyTrainer, "train_step", dies_at_iteration_2)
    with pytest.raises(Killed):  # the 2-iteration run dies after saving iteration 1
        train(mm_config(tiny_vlm_dir, mm_data, first, iters=2, **over))
    monkeypatch.undo()
    assert sorted(metrics_by_iteration(first / "run")) == [1]
    train(mm_config(tiny_vlm_dir, mm_data, first, iters=2, actor_config__load=str(first / "ckpt"), **over))
    a, b = metrics_by_iteration(straight / "run"), metrics_by_iteration(first / "run")
    keys = [k for k in a[2] if not k.startswith("timing/") and not k.endswith("_tps") and k != "time"]
    for k in keys:
        assert b[2][k] == pytest.approx(a[2][k], rel=1e-5, abs=1e-7), k
    from safetensors.torch import load_file

    x = load_file(straight / "ckpt" / "iter_0000002" / "model.safetensors")
    y = load_file(first / "ckpt" / "iter_0000002" / "model.safetensors")
    for k in x:
        torch.testing.assert_close(y[k], x[k], rtol=0, atol=1e-6)


LORA = {"actor_config__lora_target_modules": ["linear_qkv", "linear_fc1"], "actor_config__lora_r": 4,
        "actor_config__lora_alpha": 8, "rl_config__freeze_vision_tower": True, "rl_config__reuse_image_embeds": True,
        "rl_config__vit_forward_micro_batch_size": 1}
DAPO = {"rl_config__freeze_vision_tower": True, "rl_config__filter_groups_enable": True, "rl_config__filter_groups_metric": "test_mm_token_share",
        "rl_config__filter_groups_train_batch_size": 2, "rl_config__filter_groups_max_batches": 4,
        "rl_config__clip_higher_enable": True, "rl_config__clip_ratio_low": 0.2, "rl_config__clip_ratio_high": 0.28}


@pytest.mark.parametrize("name,stage,over,model_dir", [("lora", "ray_grpo", LORA, "tiny_vlm_dir"),
                                                        ("dapo", "ray_dapo", DAPO, "tiny_vlm_dir"),
                                                        ("lora", "ray_grpo", {**LORA, **QWEN3}, "tiny_qwen3_vl_dir")],
                         ids=["lora", "dapo", "lora-qwen3_vl"])
def test_lora_and_dapo_run_an_iteration_on_the_vlm(mm_data, tmp_path, monkeypatch, name, stage, over, model_dir,
                                                   request):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    tiny_vlm_dir = request.getfixturevalue(model_dir)
    import posttrain.loops.multimodal  # noqa: F401  (imported first: its image_embeds phase keeps the real tower call)
    import posttrain.training.multimodal as forward
    from posttrain.commands.train import train_config as train

    real, towers = forward.image_embeds, []  # towers: the vision tower run by a log-prob pass or the update

    def counted(*args, **kwargs):
        towers.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "image_embeds", counted)
    cfg = mm_config(tiny_vlm_dir, mm_data, tmp_path, iters=1, megatron_training__stage=stage, **over)
    metrics = train(cfg)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    ckpt = tmp_path / "ckpt" / "iter_0000001"
    if name == "dapo":
        assert metrics["train/num_gen_batches"] >= 1 and "dapo/num_kept_groups" in metrics
        before = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).state_dict()
        after = AutoModelForImageTextToText.from_pretrained(ckpt).state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed and not any("visual" in k for k in changed)  # freeze_vision_tower: the tower kept
        assert towers  # without reuse_image_embeds every pass runs the tower
        return
    assert "timing/image_embeds" in metrics and towers == []  # the tower ran once, every pass reused its embeddings
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["exclude_modules"]  # the adapter keeps off the vision tower
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    saved_base = AutoModelForImageTextToText.from_pretrained(ckpt / "base").state_dict()  # what a resume loads
    assert all(torch.equal(saved_base[k], v) for k, v in base.state_dict().items())
    adapted = PeftModel.from_pretrained(base, ckpt)  # PEFT's own loader
    names = [n for n, _ in adapted.named_parameters() if "lora_B" in n]
    assert names and not any("visual" in n for n in names)
    assert any(float(p.abs().sum()) > 0 for n, p in adapted.named_parameters() if "lora_B" in n)  # trained
    resumed = train(mm_config(tiny_vlm_dir, mm_data, tmp_path, iters=2, megatron_training__stage=stage,
                              actor_config__load=str(tmp_path / "ckpt"), **over))  # the adapter resumes
    assert math.isfinite(resumed["actor/pg_loss"]) and sorted(metrics_by_iteration(tmp_path / "run")) == [1, 2]


def test_images_are_required_and_limited(mm_data, tiny_prompt_data):
    from posttrain.data.builders import build_prompt_dataset
    from posttrain.errors import DataError

    with pytest.raises(DataError, match="is_multimodal: true, but the dataset .* has no images"):
        build_prompt_dataset(tiny_prompt_data, 512, images_per_prompt=1)
    assert len(build_prompt_dataset(mm_data, 512, images_per_prompt=1)[0]["images"]) == 1
    with pytest.raises(DataError, match="prompt 0 holds 1 images, more than generate_config.limit_mm_image_per_"):
        build_prompt_dataset(mm_data, 512, images_per_prompt=0)[0]
