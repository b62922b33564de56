"""A video's model inputs from its frames (posttrain.models.video_frames), checked against the image
processor: frames in identical pairs give exactly the image patches of those frames, each temporal
slot of a patch holds its own frame, an odd frame count repeats the last frame, the prompt's
``<|video_pad|>`` becomes ``t*h*w/merge**2`` tokens."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from posttrain.models.video_frames import VIDEO_FPS, video_inputs
from posttrain.models.vlm import ImageTextProcessor
from tests.helpers.tiny_vlm import tiny_vlm_image_processor, tiny_vlm_tokenizer

C, T, P = 3, 2, 14


def frame(seed: int, size=(56, 84)) -> Image.Image:
    rng = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", size, (255, 255, 255))
    x, y, c = (int(torch.randint(0, 40, (), generator=rng)) for _ in range(3))
    ImageDraw.Draw(image).rectangle((x, y, x + 14, y + 14), fill=(6 * c, 255 - 6 * c, 3 * c))
    return image


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm_image_processor()


def test_frames_in_identical_pairs_give_the_image_patches_of_those_frames(processor):
    frames = [frame(i) for i in range(3)]
    video = video_inputs(processor, [[f for f in frames for _ in range(2)]])
    images = processor(images=frames, return_tensors="pt")
    assert torch.equal(video["pixel_values_videos"], torch.as_tensor(images["pixel_values"]).float())
    grid = images["image_grid_thw"][0].tolist()
    assert video["video_grid_thw"].tolist() == [[3, grid[1], grid[2]]]  # t = 6 frames / 2


def test_each_temporal_slot_holds_its_frame_and_an_odd_count_repeats_the_last(processor):
    frames = [frame(10 + i) for i in range(3)]
    video = video_inputs(processor, [frames])
    t, h, w = video["video_grid_thw"][0].tolist()
    assert t == 2  # 3 frames padded to 4
    slots = video["pixel_values_videos"].reshape(t, h * w, C, T, P, P)
    for k, index in enumerate([0, 1, 2, 2]):  # the 4th slot repeats frame 2
        alone = torch.as_tensor(processor(images=[frames[index]], return_tensors="pt")["pixel_values"]).float()
        assert torch.equal(slots[k // T, :, :, k % T], alone.reshape(h * w, C, T, P, P)[:, :, 0])


def test_frames_share_the_first_frames_size_and_the_seconds_per_grid(processor):
    small, large = frame(1, (56, 56)), frame(2, (112, 112))
    video = video_inputs(processor, [[small, large], [large, large]])
    assert video["video_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 8]]
    assert video["pixel_values_videos"].shape == (16 + 64, C * T * P * P)
    assert video["second_per_grid_ts"].tolist() == [T / VIDEO_FPS] * 2
    assert video_inputs(processor, [[small]], fps=0.5)["second_per_grid_ts"].tolist() == [4.0]
    assert video_inputs(processor, [])["video_grid_thw"].shape == (0, 3)


def test_the_prompts_video_pad_is_expanded_to_the_videos_tokens(processor):
    tok = tiny_vlm_tokenizer()
    encoder = ImageTextProcessor(tok, processor)
    image_id, video_id = tok.convert_tokens_to_ids("<|image_pad|>"), tok.convert_tokens_to_ids("<|video_pad|>")
    ids = [7, image_id, 8, video_id, 9]
    out = encoder.encode_images(ids, [frame(0, (56, 56))], image_id, videos=[[frame(1)] * 4], video_token_id=video_id)
    assert out["video_grid_thw"].tolist() == [[2, 6, 4]]  # 84 x 56 -> 6 x 4 patches
    assert out["input_ids"] == [7] + [image_id] * 4 + [8] + [video_id] * (2 * 6 * 4 // 4) + [9]
    with pytest.raises(ValueError, match="holds 1 video tokens for 2 videos"):
        encoder.encode_images(ids, [frame(0)], image_id, videos=[[frame(1)], [frame(2)]], video_token_id=video_id)
