"""A tiny random Qwen2.5-VL built locally (no downloads): model, word-level tokenizer with the vision
tokens, and the image processor, which :func:`write_tiny_vlm` saves together in one folder.

Text model: 2 layers, hidden 128, 4 heads, vocab 64. Vision: depth 2, hidden 64, patch 14, merge 2,
so a 112x112 image gives 8x8 patches, merged into 16 image tokens. ``kind="qwen3_vl"`` builds the
Qwen3-VL of ``configs/model/tiny_qwen3_vl.yaml`` (vision patch 16, deepstack on block 0).
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<eos>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
WORDS = ["how", "many", "shapes", "?", "red", "blue", "green", "circle", "square", "is", "there", "a",
         "picture", "of", "and", "the"] + [str(d) for d in range(10)]
VOCAB = 64


def tiny_vlm_tokenizer():
    """A whitespace word-level ``PreTrainedTokenizerFast`` of 64 ids: the specials first (pad 0, eos 1,
    vision start 2, vision end 3, image pad 4, video pad 5), then :data:`WORDS`, then filler words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = SPECIALS + WORDS
    names += [f"w{i}" for i in range(VOCAB - len(names))]
    core = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        extra_special_tokens={"image_token": "<|image_pad|>",
                                                              "video_token": "<|video_pad|>"})
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    return tokenizer


PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}  # vision patch size of each kind
MODEL_YAML = {"qwen2_5_vl": "tiny_qwen25_vl", "qwen3_vl": "tiny_qwen3_vl"}  # configs/model/<name>.yaml of each kind


def tiny_vlm(seed: int = 0, init: float = 0.02, kind: str = "qwen2_5_vl"):
    """The random VLM of ``posttrain init-model tiny_qwen25_vl`` (``kind="qwen2_5_vl"``: a
    ``Qwen2_5_VLForConditionalGeneration``, here with windowed attention in vision block 0) or
    ``tiny_qwen3_vl`` (``kind="qwen3_vl"``: a ``Qwen3VLForConditionalGeneration``, patch 16, deepstack
    on vision block 0), built by init-model's own builder
    (:func:`posttrain.models.init_model.random_model`) with vocab 64 and this tokenizer's ids; fp32,
    eval mode; ``init`` is the text model's ``initializer_range``."""
    from posttrain.config.loader import load_model_yaml
    from posttrain.models.init_model import random_model

    ids = {name: i for i, name in enumerate(SPECIALS)}
    tokens = dict(pad_token_id=0, eos_token_id=1, bos_token_id=1, image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"])
    name, keys = load_model_yaml(MODEL_YAML[kind])
    if kind == "qwen2_5_vl":
        keys = {**keys, "vision_tower": {**keys["vision_tower"], "window_size": 56, "fullatt_block_indexes": [1]}}
    model, _ = random_model(name, keys, VOCAB, tokens, seed, text_config={"initializer_range": init})
    return model.eval()


def tiny_vlm_image_processor(kind: str = "qwen2_5_vl"):
    """``Qwen2VLImageProcessor`` (merge 2; patch 14, or 16 for Qwen3-VL; 112x112 images give 16 image
    tokens). Without torchvision transformers gives its PIL variant; ``Qwen2_5_VLProcessor`` itself
    cannot be built then (its video processor needs torchvision), so :func:`encode` expands the image
    pads as that processor does."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(patch_size=PATCH[kind], merge_size=2, temporal_patch_size=2,
                                 min_pixels=56 * 56, max_pixels=256 * 256)


def encode(tokenizer, image_processor, text: str, images: list) -> dict:
    """One request: ``input_ids`` (a list, each ``<|image_pad|>`` expanded to its image's
    ``t*h*w / merge**2`` tokens, as ``Qwen2_5_VLProcessor`` does), and, when there are images,
    ``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw`` [images, 3]."""
    ids = tokenizer(text)["input_ids"]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    if not images:
        return {"input_ids": ids}
    pixels = image_processor(images=images, return_tensors="pt")
    counts = (pixels["image_grid_thw"].prod(-1) // image_processor.merge_size ** 2).tolist()
    if ids.count(pad) != len(counts):
        raise ValueError(f"{ids.count(pad)} image pads in {text!r} for {len(counts)} images")
    expanded, it = [], iter(counts)
    for token in ids:
        expanded.extend([pad] * next(it) if token == pad else [token])
    return {"input_ids": expanded, "pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}


def write_tiny_vlm(out: Path, seed: int = 0, kind: str = "qwen2_5_vl") -> Path:
    """Save :func:`tiny_vlm`, its tokenizer and its image processor in ``out``; returns ``out``."""
    out = Path(out)
    tiny_vlm(seed, kind=kind).save_pretrained(out)
    tiny_vlm_tokenizer().save_pretrained(out)
    tiny_vlm_image_processor(kind).save_pretrained(out)
    return out


def shapes_image(count: int, seed: int, size: int = 112):
    """A white ``size``x``size`` PIL image with ``count`` filled circles or squares at random places."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for _ in range(count):
        side = rng.randint(14, 22)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        colour = rng.choice(["red", "blue", "green", "orange", "purple", "black"])
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x, y, x + side, y + side], fill=colour)
    return image


def drawn_image(width: int, height: int, seed: int):
    """A ``width x height`` white picture with 3 coloured squares placed by ``seed``."""
    import torch
    from PIL import Image, ImageDraw

    rng = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x, y, c = (int(torch.randint(0, 40, (), generator=rng)) for _ in range(3))
        draw.rectangle((x, y, x + 12, y + 12), fill=(6 * c, 255 - 6 * c, 3 * c))
    return image


def image_prompt(num_images: int, words: str = "how many shapes ?") -> str:
    """The prompt text: one vision block (start, image pad, end) per image, then ``words``."""
    return "<|vision_start|> <|image_pad|> <|vision_end|> " * num_images + words


COLOURS = ["red", "blue", "green", "black"]


def colour_prompts(root: Path, model_dir, text_only: tuple[int, ...] = ()) -> str:
    """4 prompts "<image> colour?" in ``root``, each with a 56x56 picture of one coloured square (the
    label: its colour), preprocessed for the VLM in ``model_dir``; the prompts ``text_only`` get no
    picture. Returns the dataset's prefix."""
    from PIL import Image, ImageDraw

    from posttrain.data.preprocess import preprocess
    from tests.helpers.data import write_jsonl

    rows = []
    for i, colour in enumerate(COLOURS):
        image = Image.new("RGB", (56, 56), "white")
        ImageDraw.Draw(image).rectangle((8 + 4 * i, 8, 40, 40), fill=colour)
        image.save(root / f"{i}.png")
        pictured = i not in text_only
        rows.append({"problem": "<image> colour?" if pictured else "colour?", "answer": colour,
                     "images": [f"{i}.png"] if pictured else []})
    write_jsonl(root / "in.jsonl", rows)
    preprocess({"input": str(root / "in.jsonl"), "handler_name": "R1AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(model_dir), "prompt_type": "qwen2_vl",
                "output_prefix": str(root / "data" / "mm"), "map_keys": {"prompt": "problem", "response": "answer"},
                "dataset_additional_keys": ["labels"], "workers": 1}, progress=False)
    return str(root / "data" / "mm")
