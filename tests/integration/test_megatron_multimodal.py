"""Qwen2.5-VL on the megatron backend (posttrain.training.megatron.vision): the language model as
Megatron-Core's GPTModel with multimodal rotary positions, the Hugging Face vision tower frozen
beside it. Its log-probs of a packed and of a padded batch (two image rows of different sizes and a
text-only row) equal each sample's own Hugging Face forward (fp32: 1e-5 at TP 1, 1e-4 at TP 2, on
2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from tests.megatron.spawn_ranks import run_on_ranks

pytestmark = pytest.mark.slow

SIZES = [(56, 84), None, (84, 56)]  # (width, height) of each row's image; None: a text-only row
RESPONSE_LENGTHS = [5, 3, 7]


def drawn_image(width: int, height: int, seed: int):
    from PIL import Image, ImageDraw

    rng = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x, y, c = (int(torch.randint(0, 40, (), generator=rng)) for _ in range(3))
        draw.rectangle((x, y, x + 12, y + 12), fill=(6 * c, 255 - 6 * c, 3 * c))
    return image


def samples(model_dir) -> list[dict]:
    """Per row: prompt ids, response ids, its image inputs (no rows for the text-only one)."""
    from posttrain.models.vlm import empty_images, load_processor

    processor = load_processor(model_dir)
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (size, length) in enumerate(zip(SIZES, RESPONSE_LENGTHS)):
        content = ([{"type": "image"}] if size else []) + [{"type": "text", "text": f"How many shapes? {i}"}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        inputs = processor(text=[text], images=[drawn_image(*size, i)] if size else None)
        image = {**empty_images(processor.image_processor),
                 **({k: inputs[k] for k in ("pixel_values", "image_grid_thw")} if size else {})}
        out.append({"prompt": torch.as_tensor(inputs["input_ids"][0]),
                    "response": torch.randint(3, 250, (length,), generator=gen), "image": image})
    return out


def reference_logprobs(model, sample) -> torch.Tensor:
    """The sample alone through Hugging Face's own forward: log-probs of its response tokens."""
    ids = torch.cat([sample["prompt"], sample["response"]])[None]
    kwargs = {k: v for k, v in sample["image"].items() if v.shape[0]}
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), **kwargs).logits
    start, length = sample["prompt"].numel(), sample["response"].numel()
    logp = torch.log_softmax(logits[0, start - 1:start + length - 1].float(), dim=-1)
    return logp.gather(-1, sample["response"][:, None])[:, 0]


def megatron_batch(model, rows) -> dict:
    from posttrain.models.vlm import SampleImages
    from posttrain.training.batch import build_batch

    batch = build_batch([s["prompt"] for s in rows], [s["response"] for s in rows],
                        pad_token_id=model.config.text_config.pad_token_id)
    return {**batch, "images": SampleImages([s["image"] for s in rows])}


def logprobs_worker(rank: int, model_dir: str) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForImageTextToText

    from posttrain.training.megatron.cpu_shims import cpu_megatron
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_to_megatron
    from posttrain.training.megatron.vision import VisionInputs
    from posttrain.training.multimodal import freeze_vision_tower
    from posttrain.training.options import EngineOptions

    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    freeze_vision_tower(hf)
    rows = samples(model_dir)
    want = [reference_logprobs(hf, s) for s in rows]
    batch = megatron_batch(hf, rows)
    with cpu_megatron():
        for tp, atol in ((1, 1e-5), (2, 1e-4)):
            ps.initialize_model_parallel(tensor_model_parallel_size=tp)
            [chunk], _ = hf_to_megatron(model_dir)
            for packed in (True, False):
                engine = MegatronEngine(chunk, vocab_size=hf.config.text_config.vocab_size, micro_batch_size=3,
                                        options=EngineOptions(use_remove_padding=packed), vision=VisionInputs(hf))
                got = engine.compute_logprobs(batch)
                for row, ref in enumerate(want):
                    torch.testing.assert_close(got[row, :ref.numel()], ref, rtol=0, atol=atol,
                                               msg=f"TP {tp}, packed {packed}, row {row}")
                    assert torch.all(got[row, ref.numel():] == 0)
            # the images matter: row 0's patches in another order give other log-probs
            image = rows[0]["image"]
            flipped = megatron_batch(hf, [{**rows[0], "image": {**image, "pixel_values": image["pixel_values"].flip(0)}}])
            other = engine.compute_logprobs(flipped)[0, :want[0].numel()]
            assert (other - want[0]).abs().max() > 10 * atol
            ps.destroy_model_parallel()


def test_megatron_vlm_logprobs_equal_each_samples_hf_forward(tiny_vlm_dir, tmp_path):
    run_on_ranks(logprobs_worker, str(tiny_vlm_dir), out=tmp_path)
