"""Videos in the multimodal loop (Qwen2.5-VL, hf backend, native engine), on the tiny Qwen2.5-VL of
``posttrain init-model``: a video is a list of frames (PIL images), its inputs built without
torchvision (:mod:`posttrain.models.video_frames`).

* A packed (and a padded) batch mixing an image sample, a video sample and a text-only sample gives
  each row the log-probs of its own Hugging Face forward (``pixel_values_videos``, ``video_grid_thw``,
  ``second_per_grid_ts``), fp32, 1e-5; the frames' order matters.
* The native engine's greedy tokens with a video equal Hugging Face ``generate`` with the same inputs.
* GRPO runs 2 iterations on prompts of 4-frame videos of coloured squares: finite metrics, the
  weights change; a prompt with more videos than ``limit_mm_video_per_prompt`` is refused.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from posttrain.models.vlm import load_processor
from posttrain.training.batch import build_batch
from posttrain.training.forward import response_logprobs
from posttrain.training.remove_padding import Packing

pytestmark = pytest.mark.usefixtures("one_thread")
COLOURS = ["red", "blue", "green", "black"]


def square_frames(colour: str, frames: int = 4, size: int = 56) -> list[Image.Image]:
    """``frames`` pictures of a ``colour`` square moving right by 4 pixels a frame."""
    out = []
    for f in range(frames):
        image = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(image).rectangle((4 + 4 * f, 8, 28 + 4 * f, 32), fill=colour)
        out.append(image)
    return out


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_dir), dtype=torch.float32).eval()
    return model, load_processor(tiny_vlm_dir)


def prompt_ids(processor, model, text: str, images=(), videos=()) -> dict:
    ids = processor.tokenizer(text)["input_ids"]
    return processor.encode_images(ids, list(images), model.config.image_token_id, videos=list(videos),
                                   video_token_id=model.config.video_token_id)


@pytest.fixture(scope="module")
def samples(vlm):
    """An image sample, a video sample (5 frames: the last one repeated), a text-only sample, each with a response."""
    model, processor = vlm
    image = square_frames("red", 1, size=84)[0]
    encoded = [prompt_ids(processor, model, "<|vision_start|> <|image_pad|> <|vision_end|> how many shapes ?", [image]),
               prompt_ids(processor, model, "<|vision_start|> <|video_pad|> <|vision_end|> how many ?",
                          videos=[square_frames("blue", 5)]),
               prompt_ids(processor, model, "how many shapes ?")]
    gen = torch.Generator().manual_seed(0)
    out = []
    for enc, length in zip(encoded, (5, 3, 6)):
        media = {k: v for k, v in enc.items() if k != "input_ids"}
        out.append({"prompt": torch.tensor(enc["input_ids"]), "response": torch.randint(6, 60, (length,), generator=gen),
                    "media": media})
    return out


def reference_logprobs(model, sample) -> torch.Tensor:
    """The sample alone through Hugging Face's forward, given only its own images or videos."""
    ids = torch.cat([sample["prompt"], sample["response"]])[None]
    types = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
    media = {k: v for k, v in sample["media"].items() if v.shape[0]}
    if "second_per_grid_ts" in media:
        media["second_per_grid_ts"] = media["second_per_grid_ts"].tolist()
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=types, **media).logits[0].float()
    start, length = sample["prompt"].numel(), sample["response"].numel()
    return torch.log_softmax(logits[start - 1:start + length - 1], -1).gather(-1, sample["response"][:, None])[:, 0]


@pytest.mark.parametrize("packing", [Packing(), None], ids=["packed", "padded"])
def test_a_batch_of_image_video_and_text_rows_equals_each_rows_own_forward(vlm, samples, packing):
    from posttrain.models.vlm import SampleImages

    model, _ = vlm
    assert samples[1]["media"]["video_grid_thw"].tolist() == [[3, 4, 4]]  # 5 frames -> 6 -> t = 3
    batch = build_batch([s["prompt"] for s in samples], [s["response"] for s in samples], pad_token_id=0)
    batch["images"] = SampleImages([s["media"] for s in samples])
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, batch, packing=packing)
    references = [reference_logprobs(model, s) for s in samples]
    for row, ref in enumerate(references):
        torch.testing.assert_close(logprobs[row, :ref.numel()], ref, rtol=0, atol=1e-5)
    # the frames' order matters: the video reversed in time gives other log-probs
    media = samples[1]["media"]
    t, h, w = media["video_grid_thw"][0].tolist()
    flipped = media["pixel_values_videos"].reshape(t, h * w, -1).flip(0).reshape(t * h * w, -1)
    other = reference_logprobs(model, {**samples[1], "media": {**media, "pixel_values_videos": flipped}})
    assert not torch.allclose(other, references[1], atol=1e-4)
