"""Log-probs of a multimodal (Qwen2.5-VL, Qwen3-VL) micro-batch on the hf backend: packed and padded batches
equal each sample's own Hugging Face forward; reused image embeddings equal recomputed ones; a
frozen vision tower gets no gradient."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_vlm import drawn_image

from posttrain.models.vlm import concat_samples, load_processor
from posttrain.training.batch import build_batch
from posttrain.training.forward import response_logprobs
from posttrain.training.multimodal import freeze_vision_tower, image_embeds, vision_tower
from posttrain.training.remove_padding import Packing

SIZES = [(56, 84), (56, 56), (84, 56)]  # (width, height): 6 x 4, 4 x 4 and 4 x 6 patches
QUESTIONS = ["How many shapes?", "Count them.", "What is shown here, and how many?"]
RESPONSE_LENGTHS = [5, 2, 7]


@pytest.fixture(scope="module", params=["tiny_vlm_dir", "tiny_qwen3_vl_dir"], ids=["qwen2_5_vl", "qwen3_vl"])
def vlm(request):
    """The tiny Qwen2.5-VL, then the tiny Qwen3-VL (deepstack on vision block 0) of ``posttrain init-model``."""
    from transformers import AutoModelForImageTextToText

    model_dir = request.getfixturevalue(request.param)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return model, load_processor(model_dir)


@pytest.fixture(scope="module")
def samples(vlm):
    """Per sample: prompt ids (an image, then a question), response ids, its image inputs."""
    _, processor = vlm
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, ((w, h), question, length) in enumerate(zip(SIZES, QUESTIONS, RESPONSE_LENGTHS)):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[drawn_image(w, h, i)])
        response = torch.randint(3, 250, (length,), generator=gen)  # plain text tokens
        out.append({"prompt": inputs["input_ids"][0], "response": response,
                    "image": {k: inputs[k] for k in ("pixel_values", "image_grid_thw")}})
    return out


def reference_logprobs(model, sample) -> torch.Tensor:
    """The sample alone through Hugging Face's own forward (it merges the image features and builds
    the 3-D positions itself): log-probs of its response tokens."""
    ids = torch.cat([sample["prompt"], sample["response"]])[None]
    mm_types = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=mm_types, **sample["image"]).logits[0].float()
    start, length = sample["prompt"].numel(), sample["response"].numel()
    logp = torch.log_softmax(logits[start - 1:start + length - 1], dim=-1)
    return logp.gather(-1, sample["response"][:, None])[:, 0]


def multimodal_batch(model, samples) -> dict[str, torch.Tensor]:
    batch = build_batch([s["prompt"] for s in samples], [s["response"] for s in samples],
                        pad_token_id=model.config.text_config.pad_token_id)
    batch.update(concat_samples([s["image"] for s in samples]))
    return batch


def check_equal(logprobs: torch.Tensor, references: list[torch.Tensor]) -> None:
    for row, ref in enumerate(references):
        torch.testing.assert_close(logprobs[row, :ref.numel()], ref, rtol=0, atol=1e-5)
        assert torch.all(logprobs[row, ref.numel():] == 0)


@pytest.mark.parametrize("packing", [Packing(), None], ids=["packed", "padded"])
def test_multimodal_batch_logprobs_equal_each_sample_alone(vlm, samples, packing):
    model, _ = vlm
    references = [reference_logprobs(model, s) for s in samples]
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, multimodal_batch(model, samples), packing=packing)
    check_equal(logprobs, references)
    # the image matters: row 0 with its patches in another order has other log-probs
    image = samples[0]["image"]
    shuffled = {**samples[0], "image": {**image, "pixel_values": image["pixel_values"].flip(0)}}
    assert not torch.allclose(reference_logprobs(model, shuffled), references[0], atol=1e-4)


def test_reused_image_embeds_equal_recomputed_and_skip_the_tower(vlm, samples):
    model, _ = vlm
    batch = multimodal_batch(model, samples)
    with torch.no_grad():
        recomputed, _ = response_logprobs(model, batch, packing=Packing())
        embeds = image_embeds(model, batch["pixel_values"], batch["image_grid_thw"])
        calls = []
        hook = vision_tower(model).register_forward_hook(lambda *args: calls.append(1))
        try:
            reused, _ = response_logprobs(model, {**batch, "image_embeds": embeds}, packing=Packing())
        finally:
            hook.remove()
    assert calls == []
    torch.testing.assert_close(reused, recomputed, rtol=0, atol=1e-6)
    hidden = model.config.text_config.hidden_size
    if embeds.shape[-1] > hidden:  # Qwen3-VL: the deepstack features are reused too, and they matter
        no_deepstack = torch.cat([embeds[:, :hidden], torch.zeros_like(embeds[:, hidden:])], dim=-1)
        with torch.no_grad():
            other, _ = response_logprobs(model, {**batch, "image_embeds": no_deepstack}, packing=Packing())
        assert not torch.allclose(other, recomputed, atol=1e-4)
    with pytest.raises(ValueError, match="image tokens for"):
        response_logprobs(model, {**batch, "image_embeds": embeds[:-1]}, packing=Packing())
    # videos without their tokens: refused
    videos = {"pixel_values_videos": batch["pixel_values"], "video_grid_thw": batch["image_grid_thw"]}
    with pytest.raises(ValueError, match="video tokens for"):
        response_logprobs(model, {**batch, **videos}, packing=Packing())


@pytest.mark.parametrize("frozen", [True, False])
def test_frozen_vision_tower_gets_no_gradient(vlm, samples, frozen):
    model, _ = vlm
    freeze_vision_tower(model, frozen)
    try:
        model.zero_grad(set_to_none=True)
        logprobs, _ = response_logprobs(model, multimodal_batch(model, samples), packing=Packing())
        (-logprobs.sum()).backward()
        tower = [p.grad for p in vision_tower(model).parameters()]
        text = [p.grad for p in model.model.language_model.parameters()]
        assert all(g is not None and g.abs().sum() > 0 for g in text)
        if frozen:
            assert all(g is None for g in tower)
        else:
            assert all(g is not None for g in tower) and sum(g.abs().sum() for g in tower) > 0
    finally:
        freeze_vision_tower(model, False)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("budget", [None, 120], ids=["micro-3", "token-budget"])
def test_the_updates_micro_batches_carry_each_rows_images(vlm, samples, budget):
    """The loop's path: the dock's per-sample image cells -> read_batch (SampleImages beside the rows)
    -> TrainEngine.update (shuffled mini-batch, packed micro-batches of 3 rows or of <= 120 tokens, the
    tower one image at a time): each row's log-probs equal its own HF forward, a text-only row too."""
    from posttrain.loops.experience import new_dock, read_batch
    from posttrain.models.vlm import empty_images
    from posttrain.training.engine import TrainEngine
    from posttrain.training.options import EngineOptions, TokenBudget

    model, processor = vlm
    text_only = {"prompt": processor.tokenizer("Count.", return_tensors="pt")["input_ids"][0],
                 "response": torch.tensor([7, 8, 9]), "image": empty_images(processor.image_processor)}
    rows = [*samples, text_only]
    references = [reference_logprobs(model, s) for s in samples[:3]]
    ids = torch.cat([text_only["prompt"], text_only["response"]])[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, -4:-1].float(), -1)
    references.append(logp.gather(-1, text_only["response"][:, None])[:, 0])
    td = new_dock(len(rows), 1, guarantee_order=True, seed=0, extra_columns=("pixel_values", "image_grid_thw"))
    td.put_prompts({"prompts": [s["prompt"] for s in rows], "prompt_length": [len(s["prompt"]) for s in rows],
                    "pixel_values": [s["image"]["pixel_values"] for s in rows],
                    "image_grid_thw": [s["image"]["image_grid_thw"] for s in rows]})
    td.put(["responses", "response_length"], list(range(len(rows))),
           [[s["response"] for s in rows], [len(s["response"]) for s in rows]])
    batch, idx, _ = read_batch(td, "actor_update", [], None, pad_token_id=0, indexes=range(len(rows)),
                               vit_micro_batch_size=1)
    batch["row"] = torch.tensor(idx)
    seen = {}

    def record(m, micro, *, num_tokens, num_seqs, packing):
        logprobs, _ = response_logprobs(m, micro, packing=packing)
        for r, lp in zip(micro["row"].tolist(), logprobs):
            seen[r] = lp.detach()
        return logprobs.sum() * 0.0, {}

    options = EngineOptions(use_remove_padding=True, update_budget=TokenBudget(budget) if budget else None)
    engine = TrainEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), micro_batch_size=3, options=options)
    engine.update(batch, record, mini_batch_size=4, shuffle=True, seed=1)
    model.eval()
    check_equal(torch.stack([torch.nn.functional.pad(seen[r], (0, 7 - seen[r].numel())) for r in range(4)]),
                references)
