"""The tiny Qwen2.5-VL and Qwen3-VL of ``posttrain init-model tiny_qwen25_vl / tiny_qwen3_vl``: their files, its processor and its
parameter count; per-sample image inputs split and joined again."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText

from posttrain.errors import ConfigError
from posttrain.models.arch import arch_from_hf_config, arch_from_model_yaml
from posttrain.models.vlm import concat_samples, is_vlm_dir, load_processor, split_samples


def shapes_image(width: int, height: int, count: int) -> Image.Image:
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for i in range(count):
        draw.ellipse((4 + 12 * i, 4, 14 + 12 * i, 14), fill=(200, 30 * i, 0))
    return image


# model yaml, HF class, patch size, deepstack levels
VLMS = {"tiny_vlm_dir": ("tiny_qwen25_vl", "Qwen2_5_VLForConditionalGeneration", 14, 0),
        "tiny_qwen3_vl_dir": ("tiny_qwen3_vl", "Qwen3VLForConditionalGeneration", 16, 1)}


@pytest.mark.parametrize("fixture", list(VLMS), ids=["qwen2_5_vl", "qwen3_vl"])
def test_init_model_writes_a_vlm_with_its_processor(fixture, tiny_model_dir, request):
    yaml_name, hf_class, patch, deepstack = VLMS[fixture]
    tiny_vlm_dir = request.getfixturevalue(fixture)
    assert is_vlm_dir(tiny_vlm_dir) and not is_vlm_dir(tiny_model_dir)
    cfg = json.loads((tiny_vlm_dir / "config.json").read_text())
    assert cfg["architectures"] == [hf_class]
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_dir))
    assert type(model).__name__ == hf_class
    assert len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ()) == deepstack
    built = sum(p.numel() for p in model.parameters())
    assert arch_from_hf_config(tiny_vlm_dir).num_params() == built  # what plan reports
    from posttrain.config.loader import load_model_yaml
    name, keys = load_model_yaml(yaml_name)
    assert arch_from_model_yaml(name, keys, vocab_size=cfg["text_config"]["vocab_size"]).num_params() == built
    processor = load_processor(tiny_vlm_dir)
    tok = processor.tokenizer
    for token, key in (("<|vision_start|>", "vision_start_token_id"), ("<|image_pad|>", "image_token_id"),
                       ("<|vision_end|>", "vision_end_token_id"), ("<|video_pad|>", "video_token_id")):
        assert tok.convert_tokens_to_ids(token) == cfg[key]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>How many?" in text
    out = processor(text=[text], images=[shapes_image(56, 84, 2)])
    # 84 / 14 rows, 56 / 14 columns; patch 16: resized to 96 x 64 (multiples of 16 * 2)
    assert out["image_grid_thw"].tolist() == [[1, 6, 4]]
    assert out["pixel_values"].shape == (24, 3 * 2 * patch * patch)
    assert int((out["input_ids"] == cfg["image_token_id"]).sum()) == 24 // 4  # merged 2 x 2
    kinds = (out["input_ids"] == cfg["image_token_id"]).int()  # Qwen3-VL's forward needs mm_token_type_ids
    assert model(**out, mm_token_type_ids=kinds).logits.shape[:2] == out["input_ids"].shape


def test_split_and_concat_samples_round_trip():
    grid = torch.tensor([[1, 2, 2], [1, 4, 2], [1, 2, 4]])
    pixels = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    samples = split_samples(pixels, grid, [1, 0, 2])
    assert [s["pixel_values"].shape[0] for s in samples] == [4, 0, 16]
    assert samples[2]["image_grid_thw"].tolist() == [[1, 4, 2], [1, 2, 4]]
    joined = concat_samples(samples)
    assert torch.equal(joined["pixel_values"], pixels) and torch.equal(joined["image_grid_thw"], grid)
    with pytest.raises(ValueError, match="3 image_grid_thw rows"):
        split_samples(pixels, grid, [1, 1])
    # reused embeddings: a text-only sample's empty cell joins Qwen3-VL's wider ones ((1 + deepstack) * H)
    from posttrain.models.vlm import SampleImages

    wide = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    cells = [{**samples[0], "image_embeds": wide}, {**samples[1], "image_embeds": torch.zeros(0, 3)}]
    assert torch.equal(SampleImages(cells).concat()["image_embeds"], wide)
    assert SampleImages(cells[1:]).concat()["image_embeds"].shape == (0, 3)


def test_vision_tower_keys_are_checked():
    keys = {"hf_model_type": "qwen2_5_vl", "num_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
            "padded_vocab_size": 304, "add_qkv_bias": True}
    with pytest.raises(ConfigError, match="give its vision_tower sizes"):
        arch_from_model_yaml("m", keys)
    with pytest.raises(ConfigError, match="vision_tower.depthh is not a qwen2_5_vl vision tower key"):
        arch_from_model_yaml("m", {**keys, "vision_tower": {"depthh": 2}})
    with pytest.raises(ConfigError, match="hf_model_type=qwen3_vl_moe: this vision-language model is not built yet"):
        arch_from_model_yaml("m", {**keys, "hf_model_type": "qwen3_vl_moe", "vision_tower": {"depth": 1}})
    with pytest.raises(ConfigError, match="vision_tower is read for hf_model_type qwen2_5_vl, qwen3_vl, not qwen2"):
        arch_from_model_yaml("m", {**keys, "hf_model_type": "qwen2", "vision_tower": {"depth": 1}})
    tower = {"depth": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128}
    with pytest.raises(ConfigError, match="add_qkv_bias=False with hf_model_type=qwen2_5_vl"):
        arch_from_model_yaml("m", {**keys, "add_qkv_bias": False, "vision_tower": tower})
    qwen3 = {**keys, "hf_model_type": "qwen3_vl", "vision_tower": tower, "add_qkv_bias": False}
    with pytest.raises(ConfigError, match="qk_layernorm=False with hf_model_type=qwen3_vl: .* set qk_layernorm: true"):
        arch_from_model_yaml("m", qwen3)
    qwen3["qk_layernorm"] = True
    with pytest.raises(ConfigError, match="vision_tower.window_size is not a qwen3_vl vision tower key"):
        arch_from_model_yaml("m", {**qwen3, "vision_tower": {**tower, "window_size": 56}})
    with pytest.raises(ConfigError, match=r"deepstack_visual_indexes=\[2\] must be a list of distinct block indexes"):
        arch_from_model_yaml("m", {**qwen3, "vision_tower": {**tower, "deepstack_visual_indexes": [2]}})
