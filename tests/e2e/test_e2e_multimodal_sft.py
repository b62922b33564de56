"""Multimodal SFT through ``posttrain sft`` (rl_config.is_multimodal with stage sft) on the tiny
Qwen2.5-VL of ``posttrain init-model``, one process on the hf backend: 4 samples (one with two
56x56 pictures, one text-only), the whole set each iteration.

* The first step's loss equals a plain Hugging Face forward's masked cross-entropy on the same
  samples (fp32, 1e-5), packed (use_remove_padding) and padded; three steps lower it.
* The checkpoint loads with ``AutoModelForImageTextToText`` and ``load_processor``; the vision tower
  learns, or, with ``freeze_vision_tower``, stays as it was; a run that dies after saving iteration 1,
  resumed, repeats the straight run's metrics and weights; LoRA trains an adapter off the tower.
* ``posttrain preprocess`` refuses a missing image file and too many images, naming the row and file.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image, ImageDraw

from tests.helpers.configs import OMIT, run_config
from tests.helpers.runs import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
ROWS = [  # (prompt, response, image colours)
    ("<image> colour?", "red square", ["red"]),
    ("<image> what is there?", "a blue square on white", ["blue"]),
    ("<image> <image> same colour?", "no , green and black", ["green", "black"]),
    ("say hi", "hi there", []),
]


def metrics_by_iteration(run_dir):
    return {r["iteration"]: r for r in read_metrics(run_dir) if "sft/loss" in r}


def write_rows(root, rows):
    from tests.helpers.data import write_jsonl

    out = []
    for i, (prompt, response, colours) in enumerate(rows):
        images = []
        for j, colour in enumerate(colours):
            image = Image.new("RGB", (56, 56), "white")
            ImageDraw.Draw(image).rectangle((8 + 4 * j, 8, 40, 40), fill=colour)
            image.save(root / f"{i}_{j}.png")
            images.append(f"{i}_{j}.png")
        out.append({"prompt": prompt, "response": response, "images": images})
    write_jsonl(root / "in.jsonl", out)
    return root / "in.jsonl"


def preprocess_sft(source, model_dir, prefix, limit=2):
    from posttrain.data.preprocess import preprocess

    preprocess({"input": str(source), "handler_name": "AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(model_dir), "prompt_type": "qwen2_vl", "output_prefix": str(prefix),
                "map_keys": {"prompt": "prompt", "response": "response"}, "limit_mm_image_per_prompt": limit,
                "workers": 1}, progress=False)
    return str(prefix)


@pytest.fixture(scope="module")
def sft_data(tiny_vlm_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("mm_sft")
    return preprocess_sft(write_rows(root, ROWS), tiny_vlm_dir, root / "data" / "sft")


def sft_config(model_dir, data, out, iters=3, **over):
    """4 samples a step (micro-batches of 2), lr 1e-3, a checkpoint every iteration."""
    sections = {"megatron_training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 128, "lr": 1e-3,
                                      "seed": 5, "prompt_type": "qwen2_vl", "save": str(out / "ckpt"),
                                      "save_interval": 1, "dataset_additional_keys": OMIT},
                "rl_config": {"is_multimodal": True}, "generate_config": {"limit_mm_image_per_prompt": 2},
                "actor_config": {}}
    for key, value in over.items():
        section, name = key.split("__")
        sections.setdefault(section, {})[name] = value
    return run_config(model_dir, data, out / "run", name="mm_sft_test", stage="sft", iters=iters, **sections)


@pytest.fixture(scope="module")
def straight(tiny_vlm_dir, sft_data, tmp_path_factory):
    """The reference run: 3 SFT steps, packed micro-batches, the vision tower trained."""
    from posttrain.commands.train import train_config as train

    out = tmp_path_factory.mktemp("mm_sft_straight")
    train(sft_config(tiny_vlm_dir, sft_data, out))
    return out


def qwen3_video_prompt(model_dir, ids, labels, sizes, frames, patches):
    """A Qwen3-VL sample's ids and labels as its processor writes the prompt text (the prompt: the
    tokens before the first label, decoded): each image pad repeated by its size, each
    ``<|vision_start|><|video_pad|><|vision_end|>`` replaced, per temporal patch, by ``<t seconds>``
    (the mean time of the patch's two frames, 2 frames a second, an odd count repeating the last)
    and the patch's own vision block; the text tokenized whole."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_pad, video_pad = "<|image_pad|>", "<|video_pad|>"
    first = next(k for k, label in enumerate(labels) if label != -100)
    pieces = tokenizer.decode(ids[:first]).split("<|vision_start|>" + video_pad + "<|vision_end|>")
    image_sizes = sizes[tokenizer.convert_tokens_to_ids(image_pad)]
    pieces = [p.replace(image_pad, image_pad * next(image_sizes)) if image_pad in p else p for p in pieces]
    text, video_sizes = pieces[0], sizes[tokenizer.convert_tokens_to_ids(video_pad)]
    for piece, count, t in zip(pieces[1:], frames, patches):
        per_frame = next(video_sizes) // t
        index = list(range(count)) + [count - 1] * (count % 2)
        for k in range(t):
            text += f"<{(index[2 * k] + index[2 * k + 1]) / 4:.1f} seconds><|vision_start|>"
            text += video_pad * per_frame + "<|vision_end|>"
        text += piece
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    return prompt + ids[first:], [-100] * len(prompt) + labels[first:]


def hf_masked_cross_entropy(model_dir, data) -> float:
    """The token-mean cross-entropy of the response tokens of every stored sample, each by its own
    Hugging Face forward (image and video pads expanded to their tokens, as Qwen2.5-VL's processor
    does; a video's inputs from its frames: posttrain.models.video_frames, as the model takes them)."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from posttrain.data.datasets import SFTDataset
    from posttrain.data.media_store import ImageDataset
    from posttrain.models.video_frames import video_inputs

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    pads = (model.config.image_token_id, model.config.video_token_id)
    texts, media, total, count = SFTDataset(data), ImageDataset(data), 0.0, 0
    for i in range(len(texts)):
        ids, labels = texts[i]["input_ids"].tolist(), texts[i]["labels"].tolist()
        images = [im.convert("RGB") for im in media[i]["images"]]
        videos = [[frame.convert("RGB") for frame in frames] for frames in media[i]["videos"]]
        inputs, sizes = {}, {pad: iter(()) for pad in pads}
        if images:
            inputs = dict(processor(images=images, return_tensors="pt"))
            sizes[pads[0]] = iter((inputs["image_grid_thw"].prod(-1) // 4).tolist())
        if videos:
            clips = video_inputs(processor, videos)
            inputs.update(pixel_values_videos=clips["pixel_values_videos"], video_grid_thw=clips["video_grid_thw"],
                          second_per_grid_ts=clips["second_per_grid_ts"].tolist())
            sizes[pads[1]] = iter((clips["video_grid_thw"].prod(-1) // 4).tolist())
        if videos and model.config.model_type == "qwen3_vl":  # the processor's text: times around the frames
            ids, labels = qwen3_video_prompt(model_dir, ids, labels, sizes, [len(v) for v in videos],
                                             inputs["video_grid_thw"][:, 0].tolist())
        else:
            pairs = [(t, lab) for t, lab in zip(ids, labels) for _ in range(next(sizes[t]) if t in pads else 1)]
            ids, labels = [t for t, _ in pairs], [-100 if t in pads else lab for t, lab in pairs]
        ids = torch.tensor([ids])
        kinds = (ids == pads[0]).int() + 2 * (ids == pads[1]).int()  # Transformers' 3-D positions: image 1, video 2
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=kinds, **inputs).logits[0, :-1].double()
        target = torch.tensor(labels[1:])
        keep = target != -100
        total += float(torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum"))
        count += int(keep.sum())
    return total / count


@pytest.mark.parametrize("packed", [True, False])
def test_the_first_step_loss_is_the_hf_masked_cross_entropy(tiny_vlm_dir, sft_data, straight, tmp_path, packed):
    if packed:
        metrics = metrics_by_iteration(straight / "run")
        assert metrics[3]["sft/loss"] < metrics[2]["sft/loss"] < metrics[1]["sft/loss"]  # the steps learn
        first = metrics[1]
    else:
        from posttrain.commands.train import train_config as train

        train(sft_config(tiny_vlm_dir, sft_data, tmp_path, iters=1, rl_config__use_remove_padding=False,
                         megatron_training__save=OMIT))
        first = metrics_by_iteration(tmp_path / "run")[1]
    assert first["sft/loss"] == pytest.approx(hf_masked_cross_entropy(tiny_vlm_dir, sft_data), rel=1e-5)


def test_qwen3_vl_first_step_loss_is_the_hf_masked_cross_entropy(tiny_qwen3_vl_dir, tmp_path):
    """The same on the tiny Qwen3-VL (patch 16, deepstack features injected into the first layer)."""
    from posttrain.commands.train import train_config as train

    data = preprocess_sft(write_rows(tmp_path, ROWS), tiny_qwen3_vl_dir, tmp_path / "data" / "sft")
    train(sft_config(tiny_qwen3_vl_dir, data, tmp_path, iters=1, megatron_training__save=OMIT))
    first = metrics_by_iteration(tmp_path / "run")[1]
    assert first["sft/loss"] == pytest.approx(hf_masked_cross_entropy(tiny_qwen3_vl_dir, data), rel=1e-5)


def square_clip(colour: str, frames: int = 4) -> list[Image.Image]:
    """``frames`` pictures of a ``colour`` square moving right by 6 pixels a frame."""
    out = []
    for f in range(frames):
        image = Image.new("RGB", (56, 56), "white")
        ImageDraw.Draw(image).rectangle((4 + 6 * f, 8, 28 + 6 * f, 32), fill=colour)
        out.append(image)
    return out


@pytest.mark.parametrize("model_dir", ["tiny_vlm_dir", "tiny_qwen3_vl_dir"], ids=["qwen2_5_vl", "qwen3_vl"])
def test_videos_first_step_loss_is_the_hf_masked_cross_entropy(model_dir, tmp_path, request):
    """Samples with a video (4 and 3 frames), an image and a video, and text only (limit_mm_video_per_prompt
    1): the first step's loss (packed) equals Hugging Face's masked cross-entropy with the videos; the
    video pads are expanded (4 frames of 56x56: 8 tokens, labels -100 there). Qwen3-VL: the prompt as
    its processor writes it, each temporal patch's time before its frame tokens."""
    tiny_vlm_dir = request.getfixturevalue(model_dir)
    from posttrain.commands.train import train_config as train
    from posttrain.data.builders import build_offline_dataset
    from posttrain.data.preprocess import preprocess
    from posttrain.errors import DataError
    from posttrain.loops.sft_images import image_samples
    from posttrain.models.vlm import load_processor
    from tests.helpers.data import write_jsonl

    rows = []
    for i, (prompt, response, colour, frames) in enumerate([("<video> which colour?", "red", "red", 4),
                                                            ("<image> <video> same colour?", "no , blue", "green", 3),
                                                            ("<video> moving?", "yes to the right", "black", 4),
                                                            ("say hi", "hi there", None, 0)]):
        names = []
        for f, frame in enumerate(square_clip(colour, frames) if colour else []):
            frame.save(tmp_path / f"{i}_{f}.png")
            names.append(f"{i}_{f}.png")
        images = []
        if "<image>" in prompt:
            square_clip("blue", 1)[0].save(tmp_path / "still.png")
            images = ["still.png"]
        rows.append({"prompt": prompt, "response": response, "images": images, "videos": [names] if names else []})
    write_jsonl(tmp_path / "in.jsonl", rows)
    data = tmp_path / "data" / "sftv"
    preprocess({"input": str(tmp_path / "in.jsonl"), "handler_name": "AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(tiny_vlm_dir), "prompt_type": "qwen2_vl", "output_prefix": str(data),
                "map_keys": {"prompt": "prompt", "response": "response"}, "limit_mm_image_per_prompt": 1,
                "limit_mm_video_per_prompt": 1, "workers": 1}, progress=False)
    processor = load_processor(tiny_vlm_dir)
    pad = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    item = build_offline_dataset(str(data), "sft", seq_length=128, images_per_sample=1, videos_per_sample=1)[0]
    (ids, labels), = image_samples([item], processor, processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                                   str(data))[0]
    assert ids.tolist().count(pad) == 8 and labels[ids == pad].tolist() == [-100] * 8
    with pytest.raises(DataError, match="prompt 0 holds 1 video.*limit_mm_video_per_prompt=0"):
        build_offline_dataset(str(data), "sft", seq_length=128, images_per_sample=1)[0]
    train(sft_config(tiny_vlm_dir, str(data), tmp_path, iters=1, megatron_training__save=OMIT,
                     generate_config__limit_mm_image_per_prompt=1, generate_config__limit_mm_video_per_prompt=1))
    first = metrics_by_iteration(tmp_path / "run")[1]
    assert first["sft/loss"] == pytest.approx(hf_masked_cross_entropy(tiny_vlm_dir, str(data)), rel=1e-5)


def test_the_checkpoint_loads_and_the_tower_learns(tiny_vlm_dir, straight):
    from transformers import AutoModelForImageTextToText

    from posttrain.models.vlm import load_processor

    ckpt = straight / "ckpt" / "iter_0000003"
    before = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(ckpt).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)
    out = load_processor(ckpt)(text=["<|vision_start|><|image_pad|><|vision_end|> hi"], images=[Image.new("RGB", (56, 56))])
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


class Killed(Exception):
    """The run dies here (as under a kill): nothing after it runs."""


def test_a_resumed_run_repeats_the_straight_one(tiny_vlm_dir, sft_data, straight, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from posttrain.commands.train import train_config as train
    from posttrain.loops.offline import SFTTrainer

    real, calls = SFTTrainer.batch, []

    def dies_at_iteration_2(self):
        calls.append(1)
        if len(calls) == 2:
            raise Killed
        return real(self)

    monkeypatch.setattr(SFTTrainer, "batch", dies_at_iteration_2)
    with pytest.raises(Killed):  # dies after saving iteration 1
        train(sft_config(tiny_vlm_dir, sft_data, tmp_path, iters=2))
    monkeypatch.undo()
    train(sft_config(tiny_vlm_dir, sft_data, tmp_path, iters=2, actor_config__load=str(tmp_path / "ckpt")))
    a, b = metrics_by_iteration(straight / "run"), metrics_by_iteration(tmp_path / "run")
    for key in ("sft/loss", "sft/grad_norm", "sft/tokens"):
        assert b[2][key] == pytest.approx(a[2][key], rel=1e-5), key
    x = load_file(straight / "ckpt" / "iter_0000002" / "model.safetensors")
    y = load_file(tmp_path / "ckpt" / "iter_0000002" / "model.safetensors")
    for k in x:
        torch.testing.assert_close(y[k], x[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("lora", [False, True])
def test_a_frozen_tower_stays_and_lora_adapts_the_language_model(tiny_vlm_dir, sft_data, tmp_path, lora):
    from transformers import AutoModelForImageTextToText

    from posttrain.commands.train import train_config as train

    over = {"rl_config__freeze_vision_tower": True, "rl_config__vit_forward_micro_batch_size": 1}
    if lora:
        over.update(actor_config__lora_target_modules=["linear_qkv", "linear_fc1"], actor_config__lora_r=4,
                    actor_config__lora_alpha=8)
    metrics = train(sft_config(tiny_vlm_dir, sft_data, tmp_path, iters=1, **over))
    assert math.isfinite(metrics["sft/loss"]) and metrics["sft/grad_norm"] > 0
    ckpt = tmp_path / "ckpt" / "iter_0000001"
    base = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir)
    if not lora:
        before, after = base.state_dict(), AutoModelForImageTextToText.from_pretrained(ckpt).state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed and not any("visual" in k for k in changed)  # freeze_vision_tower: the tower kept
        return
    from peft import PeftModel

    assert json.loads((ckpt / "adapter_config.json").read_text())["r"] == 4
    adapted = PeftModel.from_pretrained(base, ckpt)
    trained = [n for n, p in adapted.named_parameters() if "lora_B" in n and float(p.abs().sum()) > 0]
    assert trained and not any("visual" in n for n in trained)


def test_preprocess_refuses_a_missing_image_and_too_many_images(tiny_vlm_dir, tmp_path):
    from posttrain.errors import DataError

    source = write_rows(tmp_path, ROWS)
    with pytest.raises(DataError, match=r"in\.jsonl:3: 2 images in column 'images' \(.*2_0\.png.*\), more than "
                                        r"limit_mm_image_per_prompt=1"):
        preprocess_sft(source, tiny_vlm_dir, tmp_path / "out" / "a", limit=1)
    (tmp_path / "1_0.png").unlink()
    with pytest.raises(DataError, match=r"in\.jsonl:2: images\[0\]: image file .*1_0\.png not found"):
        preprocess_sft(source, tiny_vlm_dir, tmp_path / "out" / "b")
    assert not list((tmp_path / "out").glob("*.bin"))  # nothing half-written


def test_dpo_with_images_stays_refused_and_sft_is_planned(tiny_vlm_dir, sft_data, tmp_path):
    from posttrain.config.plan import resolve_plan
    from posttrain.errors import ConfigError

    plan = resolve_plan(sft_config(tiny_vlm_dir, sft_data, tmp_path, iters=1))
    assert plan.multimodal is not None and plan.multimodal.images_per_prompt == 2
    with pytest.raises(ConfigError, match="mm-stage|stage dpo"):
        resolve_plan(sft_config(tiny_vlm_dir, sft_data, tmp_path, iters=1, megatron_training__stage="dpo",
                              megatron_training__is_pairwise_dataset=True))
    with pytest.raises(ConfigError, match="reuse_image_embeds.*stage sft"):
        resolve_plan(sft_config(tiny_vlm_dir, sft_data, tmp_path, iters=1, rl_config__freeze_vision_tower=True,
                              rl_config__reuse_image_embeds=True))


def test_a_sample_cut_inside_its_images_is_refused(tiny_vlm_dir, sft_data):
    from posttrain.data.builders import build_offline_dataset
    from posttrain.errors import DataError
    from posttrain.loops.sft_images import image_samples
    from posttrain.models.vlm import load_processor

    processor = load_processor(tiny_vlm_dir)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    whole = build_offline_dataset(sft_data, "sft", seq_length=128, images_per_sample=2)
    samples, images = image_samples([whole[2]], processor, pad, sft_data)
    assert images[0]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    assert samples[0][0].tolist().count(pad) == 8 and samples[0][1][samples[0][0] == pad].tolist() == [-100] * 8
    second = [i for i, t in enumerate(whole[2]["input_ids"].tolist()) if t == pad][1]
    cut = build_offline_dataset(sft_data, "sft", seq_length=second, images_per_sample=2)
    with pytest.raises(DataError, match=r"SFT sample 2: the prompt holds 1 image tokens for 2 images .*seq_length"):
        image_samples([cut[2]], processor, pad, sft_data)
    with pytest.raises(DataError, match="prompt 2 holds 2 images, more than generate_config.limit_mm_image_per_prompt=1"):
        build_offline_dataset(sft_data, "sft", seq_length=128, images_per_sample=1)[2]


def test_qwen3_vl_labels_follow_the_rewritten_prompt_and_a_response_video_is_refused():
    """Qwen3-VL's video prompt is rewritten (timestamps re-tokenize the text before it): the labels are
    -100 up to the response, which keeps its tokens and labels; a video in the response is refused."""
    from posttrain.errors import DataError
    from posttrain.loops.sft_images import prompt_labels

    ids, labels = [7, 8, 5, 9, 10], [-100, -100, -100, 9, 10]
    assert prompt_labels(ids, labels, [7, 11, 12, 5, 5, 13, 9, 10], "d", {"row": 3}) == [-100] * 6 + [9, 10]
    with pytest.raises(DataError, match="d: SFT sample 3: a video among the trained"):
        prompt_labels([7, 9, 5], [-100, 9, 5], [7, 9, 11, 5, 5], "d", {"row": 3})
