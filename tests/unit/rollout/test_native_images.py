"""The native engine with images on a tiny random Qwen2.5-VL and Qwen3-VL: greedy tokens equal the model's own
``generate`` for the same images (3-D rotary positions in the prefill, rope deltas in the decode),
keyed samples do not depend on the batch, text-only requests still work, bad requests are refused."""

from __future__ import annotations

import pytest
import torch

from posttrain.errors import ConfigError, DataError
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeEngine
from tests.helpers.tiny_vlm import (encode, image_prompt, shapes_image, tiny_vlm, tiny_vlm_image_processor,
                                    tiny_vlm_tokenizer)

STEPS = 8


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def vlm(kind):
    # init 0.3 (not 0.02): a random model's greedy tokens then vary from step to step, so a wrong
    # decode position changes them (with 0.02 every row repeats one token after the first)
    return tiny_vlm(seed=0, init=0.3, kind=kind)


@pytest.fixture(scope="module")
def requests(kind):
    """Prompts of unequal length with 1, 2 and 1 images, and a text-only one (left padding, images
    spread over rows)."""
    tok, images = tiny_vlm_tokenizer(), tiny_vlm_image_processor(kind)
    return [encode(tok, images, image_prompt(1), [shapes_image(1, 0)]),
            encode(tok, images, image_prompt(2, "how many red shapes ?"), [shapes_image(2, 1), shapes_image(3, 2)]),
            encode(tok, images, "how many shapes are there ?", []),
            encode(tok, images, image_prompt(1, "is there a circle"), [shapes_image(4, 3)])]


def image_inputs(requests):
    return [None if "pixel_values" not in r else {k: r[k] for k in ("pixel_values", "image_grid_thw")}
            for r in requests]


def hf_greedy(model, request) -> list[int]:
    """Reference: the model's own ``generate`` on one request (no padding), greedy, no stop token, the
    vision special tokens suppressed (the engine never samples them: rollout/images.py)."""
    ids = torch.tensor([request["input_ids"]])
    extra = {k: request[k] for k in ("pixel_values", "image_grid_thw") if k in request}
    if extra:
        extra["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS,
                             do_sample=False, eos_token_id=None, suppress_tokens=vision_ids(model), **extra)
    return out[0, ids.shape[1]:].tolist()


def vision_ids(model) -> list[int]:
    c = model.config
    return [c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id]


def tokens(outs):
    return [o.token_ids for group in outs for o in group]


@pytest.mark.parametrize("engine_args", [{}, {"static_cache": True, "max_num_seqs": 2, "max_num_batched_tokens": 40},
                                         {"speculative_tokens": 2, "speculative_budget": 16}],
                         ids=["dynamic", "static-waves-chunks", "speculative"])
def test_greedy_tokens_equal_generate_with_images(vlm, requests, engine_args):
    want = [hf_greedy(vlm, r) for r in requests]
    assert len({t for row in want for t in row}) > 8, "the reference should not repeat one token"
    engine = NativeEngine(vlm, pad_token_id=0, eos_token_ids=[], **engine_args)
    got = engine.generate([r["input_ids"] for r in requests], 1, SamplingParams(temperature=0, max_tokens=STEPS),
                          images=image_inputs(requests))
    assert tokens(got) == want
    # the same prompts without their images (text positions, no vision embeddings) give other tokens
    blind = engine.generate([r["input_ids"] for r in requests[:2]], 1, SamplingParams(temperature=0, max_tokens=STEPS))
    assert tokens(blind) != want[:2]


def test_keyed_image_samples_do_not_depend_on_the_batch(vlm, requests):
    sp = SamplingParams(temperature=1.0, top_k=-1, max_tokens=6, seed=5)
    prompts, images = [r["input_ids"] for r in requests], image_inputs(requests)
    together = tokens(NativeEngine(vlm, pad_token_id=0, eos_token_ids=[]).generate(prompts, 3, sp, images=images))
    engine = NativeEngine(vlm, pad_token_id=0, eos_token_ids=[], max_num_seqs=3)
    alone = [t for i in (3, 1, 0, 2) for t in tokens(engine.generate([prompts[i]], 3, sp, prompt_keys=[i],
                                                                       images=[images[i]]))]
    order = [t for i in (3, 1, 0, 2) for t in together[3 * i:3 * i + 3]]
    assert alone == order
    assert len({tuple(t) for t in together}) > 8  # the samples really are random


def test_text_only_requests_on_the_vision_model(vlm, requests):
    text = [requests[2], encode(tiny_vlm_tokenizer(), None, "is there a red square", [])]
    engine = NativeEngine(vlm, pad_token_id=0, eos_token_ids=[])
    got = engine.generate([r["input_ids"] for r in text], 1, SamplingParams(temperature=0, max_tokens=STEPS))
    assert tokens(got) == [hf_greedy(vlm, r) for r in text]


def test_bad_image_requests_are_refused(vlm, requests, model):
    engine, sp = NativeEngine(vlm, pad_token_id=0, eos_token_ids=[]), SamplingParams(temperature=0, max_tokens=2)
    one = requests[0]
    with pytest.raises(DataError, match="image tokens"):  # the pads of one image, the pixels of another count
        engine.generate([one["input_ids"]], 1, sp, images=image_inputs([requests[1]]))
    with pytest.raises(DataError, match="video tokens"):
        engine.generate([one["input_ids"] + [vlm.config.video_token_id]], 1, sp, images=image_inputs([one]))
    with pytest.raises(DataError, match="one per prompt"):
        engine.generate([one["input_ids"]], 1, sp, images=[])
    with pytest.raises(ConfigError, match="takes no images"):
        NativeEngine(model, pad_token_id=0, eos_token_ids=[]).generate([[5, 6]], 1, sp, images=image_inputs([one]))
    vlm.config.model_type = "qwen2_vl"  # an untested vision model type
    try:
        with pytest.raises(ConfigError, match="tested on"):
            engine.generate([one["input_ids"]], 1, sp, images=image_inputs([one]))
    finally:
        vlm.config.model_type = type(vlm.config).model_type
