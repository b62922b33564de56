"""Videos in the multimodal loop (Qwen2.5-VL, hf backend, native engine), on the tiny Qwen2.5-VL of
``posttrain init-model``: a video is a list of frames (PIL images), its inputs built without
torchvision (:mod:`posttrain.models.video_frames`).

* A packed (and a padded) batch mixing an image sample, a video sample and a text-only sample gives
  each row the log-probs of its own Hugging Face forward (``pixel_values_videos``, ``video_grid_thw``,
  ``second_per_grid_ts``), fp32, 1e-5; the frames' order and the time a temporal patch spans matter.
* The native engine's greedy tokens with videos (one at 4 s a temporal patch, whose temporal
  positions pass the text after it) equal Hugging Face ``generate`` with the same inputs.
* GRPO runs 2 iterations on prompts of 4-frame videos of coloured squares (one with an image too):
  finite metrics, the video pads expanded, the tower and the language model change; a run killed
  after iteration 1 and resumed repeats iteration 2; a prompt with more videos than
  ``limit_mm_video_per_prompt`` is refused.
* ``reuse_image_embeds``: the tower once per sample on its images and videos gives the recomputed
  log-probs, and a GRPO iteration equals the one that runs the tower in every pass.
* Qwen3-VL: a video's prompt holds each temporal patch's ``<t seconds>`` and its own vision block
  (equal to the tokens of the processor's text); a packed batch with video rows equals each row's
  own Hugging Face forward (reused embeddings too); greedy native tokens equal ``generate``; GRPO
  runs an iteration on the video prompts.
"""

from __future__ import annotations

import math

import pytest
import torch
from PIL import Image, ImageDraw

from posttrain.models.vlm import load_processor
from posttrain.reward.verifiers import register_verifier
from posttrain.training.batch import build_batch
from posttrain.training.forward import response_logprobs
from posttrain.training.remove_padding import Packing

pytestmark = pytest.mark.usefixtures("one_thread")
COLOURS = ["red", "blue", "green", "black"]


@register_verifier("test_video_token_share", overwrite=True)
def token_share(response: str, label: str, **_) -> float:
    """Dense and deterministic: the share of the response's characters that are letters of the label."""
    return sum(c in label for c in response) / max(len(response), 1)


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
        if media["video_grid_thw"].shape[0]:  # 4 s a temporal patch (fps 0.5), not the default 1 s: the time counts
            media["second_per_grid_ts"] = torch.tensor([4.0])
        out.append({"prompt": torch.tensor(enc["input_ids"]), "response": torch.randint(6, 60, (length,), generator=gen),
                    "media": media})
    return out


def reference_logprobs(model, sample, never=()) -> torch.Tensor:
    """The sample alone through Hugging Face's forward, given only its own images or videos (``never``:
    token ids left out of the softmax, as the native engine never samples the vision tokens)."""
    ids = torch.cat([sample["prompt"], sample["response"]])[None]
    types = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
    media = {k: v for k, v in sample["media"].items() if v.shape[0]}
    if "second_per_grid_ts" in media:  # (Qwen3-VL takes none: the times are in its prompt)
        seconds = media.pop("second_per_grid_ts").tolist()
        media.update({"second_per_grid_ts": seconds} if model.config.model_type == "qwen2_5_vl" else {})
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=types, **media).logits[0].float()
    logits[:, list(never)] = float("-inf")
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
    # ... and so does the time a temporal patch spans (second_per_grid_ts)
    faster = reference_logprobs(model, {**samples[1], "media": {**media, "second_per_grid_ts": torch.tensor([1.0])}})
    assert not torch.allclose(faster, references[1], atol=1e-4)


def test_reused_embeddings_of_images_and_videos_equal_the_recomputed_ones(vlm, samples):
    """reuse_image_embeds: the tower run once per sample on its images and videos (embed_samples: a
    cell of the image tokens' rows, then the video tokens') gives, packed, the log-probs of the tower
    run in the forward (1e-5), without running the tower; the video rows of the cell matter."""
    from posttrain.models.vlm import SampleImages
    from posttrain.training.multimodal import vision_tower
    from posttrain.training.sample_embeds import embed_samples

    model, _ = vlm
    media = [s["media"] for s in samples]
    media = [{**media[0], "pixel_values_videos": media[1]["pixel_values_videos"], "video_grid_thw": media[1]["video_grid_thw"],
              "second_per_grid_ts": media[1]["second_per_grid_ts"]}, *media[1:]]  # row 0: an image and a video
    prompts = [torch.cat([samples[1]["prompt"], samples[0]["prompt"]]), samples[1]["prompt"], samples[2]["prompt"]]
    batch = build_batch(prompts, [s["response"] for s in samples], pad_token_id=0)
    embeds = embed_samples(model, [m["pixel_values"] for m in media], [m["image_grid_thw"] for m in media], "cpu",
                           pixel_values_videos=[m["pixel_values_videos"] for m in media],
                           video_grid_thw=[m["video_grid_thw"] for m in media])
    assert [e.shape[0] for e in embeds] == [9 + 12, 12, 0]  # image tokens (84x84: 9), then video tokens
    calls = []
    with torch.no_grad():
        recomputed, _ = response_logprobs(model, {**batch, "images": SampleImages(media)}, packing=Packing())
        hook = vision_tower(model).register_forward_hook(lambda *args: calls.append(1))
        try:
            reused, _ = response_logprobs(model, {**batch, "images": SampleImages(
                [{**m, "image_embeds": e} for m, e in zip(media, embeds)])}, packing=Packing())
            blind = [e.clone() for e in embeds]
            blind[1][:] = 0  # the video sample's video rows
            other, _ = response_logprobs(model, {**batch, "images": SampleImages(
                [{**m, "image_embeds": e} for m, e in zip(media, blind)])}, packing=Packing())
        finally:
            hook.remove()
    assert calls == []
    torch.testing.assert_close(reused, recomputed, rtol=0, atol=1e-5)
    assert torch.equal(other[0], reused[0]) and not torch.allclose(other[1], reused[1], atol=1e-4)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_vl_dir):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_qwen3_vl_dir), dtype=torch.float32).eval()
    return model, load_processor(tiny_qwen3_vl_dir)


def test_qwen3_vl_video_prompt_is_the_processors_text(qwen3):
    """Qwen3-VL's processor writes, for each temporal patch of a video, ``<t seconds>`` (the mean time of
    its 2 frames at 2 frames a second) and the patch's own vision block in place of the video's
    ``<|vision_start|><|video_pad|><|vision_end|>``: the expanded ids equal the tokens of that text
    (built here by hand), a timestamp after a space included (" <" is one token)."""
    model, processor = qwen3
    wrapper = "<|vision_start|><|video_pad|><|vision_end|>"
    text = "<|im_start|>user\nwhat moves ? {} and\n{} colour ?<|im_end|>\n"
    enc = prompt_ids(processor, model, text.format(wrapper, wrapper),
                     videos=[square_frames("red", 5), square_frames("blue", 2)])
    grids = enc["video_grid_thw"].tolist()
    assert [g[0] for g in grids] == [3, 1]  # 5 frames -> 6 -> 3 patches; 2 frames -> 1
    blocks = [[f"<{t} seconds><|vision_start|>" + "<|video_pad|>" * (g[1] * g[2] // 4) + "<|vision_end|>" for t in times]
              for times, g in zip([("0.2", "1.2", "2.0"), ("0.2",)], grids)]
    want = processor.tokenizer(text.format(*("".join(b) for b in blocks)), add_special_tokens=False)["input_ids"]
    assert enc["input_ids"] == want
    assert processor.tokenizer.convert_tokens_to_ids("Ġ<") in want  # the first timestamp joins the text before it


@pytest.fixture(scope="module")
def qwen3_samples(qwen3):
    """Qwen3-VL: an image and a video, a video (5 frames), a text-only prompt, each with a response."""
    model, processor = qwen3
    image = square_frames("red", 1, size=84)[0]
    start, wrapper = "<|im_start|>user\n", "<|vision_start|><|video_pad|><|vision_end|>"
    encoded = [prompt_ids(processor, model, start + "<|vision_start|><|image_pad|><|vision_end|> then " + wrapper + " ?",
                          [image], [square_frames("green", 4)]),
               prompt_ids(processor, model, start + wrapper + " how many ?", videos=[square_frames("blue", 5)]),
               prompt_ids(processor, model, start + "how many shapes ?")]
    gen = torch.Generator().manual_seed(0)
    return [{"prompt": torch.tensor(enc["input_ids"]), "response": torch.randint(6, 250, (length,), generator=gen),
             "media": {k: v for k, v in enc.items() if k != "input_ids"}} for enc, length in zip(encoded, (5, 3, 6))]


def test_qwen3_vl_batch_with_videos_equals_each_rows_own_forward(qwen3, qwen3_samples):
    """A packed (and a padded) Qwen3-VL batch of an image+video row, a video row and a text row: each
    row's log-probs equal its own Hugging Face forward (fp32, 1e-5; the video's deepstack features
    too); reused embeddings (images and videos) give the same; the timestamps in the prompt matter."""
    from posttrain.models.vlm import SampleImages
    from posttrain.training.sample_embeds import embed_samples

    model, _ = qwen3
    batch = build_batch([s["prompt"] for s in qwen3_samples], [s["response"] for s in qwen3_samples], pad_token_id=0)
    media = [s["media"] for s in qwen3_samples]
    embeds = embed_samples(model, [m["pixel_values"] for m in media], [m["image_grid_thw"] for m in media], "cpu",
                           pixel_values_videos=[m["pixel_values_videos"] for m in media],
                           video_grid_thw=[m["video_grid_thw"] for m in media])
    references = [reference_logprobs(model, s) for s in qwen3_samples]
    with torch.no_grad():
        for packing, cells in ((Packing(), media), (None, media),
                               (Packing(), [{**m, "image_embeds": e} for m, e in zip(media, embeds)])):
            logprobs, _ = response_logprobs(model, {**batch, "images": SampleImages(cells)}, packing=packing)
            for row, ref in enumerate(references):
                torch.testing.assert_close(logprobs[row, :ref.numel()], ref, rtol=0, atol=1e-5)
    prompt = qwen3_samples[1]["prompt"]
    stamp = torch.nonzero(prompt == model.config.vision_start_token_id)[1, 0] - 2  # the "2" of the 2nd "<1.2 seconds>"
    other = reference_logprobs(model, {**qwen3_samples[1], "prompt": prompt.index_fill(0, stamp, int(prompt[stamp - 2]))})
    assert not torch.allclose(other, references[1], atol=1e-4)


def test_qwen3_vl_native_greedy_tokens_with_a_video_equal_hf_generate(tiny_qwen3_vl_dir, qwen3_samples):
    """The native engine's greedy tokens for Qwen3-VL prompts with videos (and an image, and none)
    equal the model's own ``generate`` (the tiny model's language weights drawn at std 0.3, so the
    greedy tokens vary)."""
    from transformers import AutoModelForImageTextToText

    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_qwen3_vl_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "language_model" in name and param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    config, steps = model.config, 8
    suppress = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    want = []
    for sample in qwen3_samples:
        ids = sample["prompt"][None]
        extra = {k: v for k, v in sample["media"].items() if v.shape[0] and k != "second_per_grid_ts"}
        if extra:
            extra["mm_token_type_ids"] = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                                 do_sample=False, eos_token_id=None, suppress_tokens=suppress, **extra)
        want.append(out[0, ids.shape[1]:].tolist())
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=[])
    media = [s["media"] if s["media"]["image_grid_thw"].shape[0] + s["media"]["video_grid_thw"].shape[0] else None
             for s in qwen3_samples]
    got = engine.generate([s["prompt"].tolist() for s in qwen3_samples], 1,
                          SamplingParams(temperature=0, max_tokens=steps), images=media)
    assert [o.token_ids for group in got for o in group] == want
    assert len({t for row in want for t in row}) > 6, "the reference should not repeat one token"
    blank = [{**m, "pixel_values_videos": torch.zeros_like(m["pixel_values_videos"])} for m in media[:2]]
    blind = engine.generate([s["prompt"].tolist() for s in qwen3_samples[:2]], 1,
                            SamplingParams(temperature=0, max_tokens=steps), images=blank)
    assert [o.token_ids for group in blind for o in group] != want[:2]  # the videos count


def test_native_greedy_tokens_with_a_video_equal_hf_generate():
    """Prompts with a video, an image and a video, and none (left padding): greedy tokens of the native
    engine equal the model's own ``generate`` with the same inputs; without the videos they differ."""
    from posttrain.models.video_frames import video_inputs
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine
    from tests.helpers.tiny_vlm import encode, shapes_image, tiny_vlm, tiny_vlm_image_processor, tiny_vlm_tokenizer

    model = tiny_vlm(seed=0, init=0.3)  # init 0.3: greedy tokens vary step to step (tests/unit/rollout)
    tok, processor = tiny_vlm_tokenizer(), tiny_vlm_image_processor()
    video = "<|vision_start|> <|video_pad|> <|vision_end|> "
    image = "<|vision_start|> <|image_pad|> <|vision_end|> "
    requests = [encode(tok, processor, video + "how many shapes ?", []),
                encode(tok, processor, image + video + "is there a square", [shapes_image(2, 1)]),
                encode(tok, processor, "how many red shapes are there ?", [])]
    clips = [[shapes_image(1, 10 + f) for f in range(4)], None, None]
    clips[1] = [shapes_image(3, 20 + f, size=84) for f in range(3)]
    merge = processor.merge_size ** 2
    for request, frames in zip(requests, clips):
        if frames is None:
            continue
        request.update(video_inputs(processor, [frames], fps=0.5 if len(frames) == 4 else 2.0))  # 4 s, 1 s a patch
        count = int(request["video_grid_thw"].prod()) // merge
        ids, request["input_ids"] = request["input_ids"], []
        for token in ids:
            request["input_ids"] += [token] * count if token == model.config.video_token_id else [token]
        request.setdefault("pixel_values", torch.zeros(0, 1176))
        request.setdefault("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
    steps, suppress = 8, [model.config.image_token_id, model.config.video_token_id, model.config.vision_start_token_id,
                          model.config.vision_end_token_id]
    want = []
    for r in requests:
        ids = torch.tensor([r["input_ids"]])
        extra = {k: v for k, v in r.items() if k != "input_ids" and v.shape[0]}
        if extra:
            extra["mm_token_type_ids"] = ((ids == model.config.image_token_id).int()
                                          + 2 * (ids == model.config.video_token_id).int())
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                                 do_sample=False, eos_token_id=None, suppress_tokens=suppress, **extra)
        want.append(out[0, ids.shape[1]:].tolist())
    engine = NativeEngine(model, pad_token_id=0, eos_token_ids=[])
    media = [None if "video_grid_thw" not in r else {k: v for k, v in r.items() if k != "input_ids"} for r in requests]
    got = engine.generate([r["input_ids"] for r in requests], 1, SamplingParams(temperature=0, max_tokens=steps),
                          images=media)
    assert [o.token_ids for group in got for o in group] == want
    assert len({t for row in want for t in row}) > 6, "the reference should not repeat one token"
    frozen = [{**m, "pixel_values_videos": torch.zeros_like(m["pixel_values_videos"])} for m in media[:2]]
    blind = engine.generate([r["input_ids"] for r in requests[:2]], 1, SamplingParams(temperature=0, max_tokens=steps),
                            images=frozen)
    assert [o.token_ids for group in blind for o in group] != want[:2]


def video_prompts(root, model_dir) -> str:
    """4 prompts "<video> colour?" (the last "<image> <video> colour?"), each video 4 frames of a moving
    square of the label's colour, preprocessed with limit_mm_video_per_prompt 1; the dataset's prefix."""
    from posttrain.data.preprocess import preprocess
    from tests.helpers.data import write_jsonl

    rows = []
    for i, colour in enumerate(COLOURS):
        names = []
        for f, frame in enumerate(square_frames(colour)):
            frame.save(root / f"{i}_{f}.png")
            names.append(f"{i}_{f}.png")
        row = {"problem": "<video> colour?", "answer": colour, "videos": [names], "images": []}
        if i == 3:
            square_frames("blue", 1)[0].save(root / "still.png")
            row.update(problem="<image> <video> colour?", images=["still.png"])
        rows.append(row)
    write_jsonl(root / "in.jsonl", rows)
    preprocess({"input": str(root / "in.jsonl"), "handler_name": "R1AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(model_dir), "prompt_type": "qwen2_vl",
                "output_prefix": str(root / "data" / "mv"), "map_keys": {"prompt": "problem", "response": "answer"},
                "dataset_additional_keys": ["labels"], "workers": 1, "limit_mm_video_per_prompt": 1}, progress=False)
    return str(root / "data" / "mv")


@pytest.fixture(scope="module")
def video_data(tiny_vlm_dir, tmp_path_factory):
    return video_prompts(tmp_path_factory.mktemp("mv"), tiny_vlm_dir)


def video_config(model_dir, data, out, iters=2, actor_config=None, lr=1e-3, rl=None, max_num_seqs=16):
    from tests.helpers.configs import OMIT, run_config

    return run_config(
        model_dir, data, out / "run", name="mv_test",
        megatron_training={"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 256, "lr": lr, "seed": 5,
                           "bf16": OMIT, "prompt_type": "qwen2_vl", "save": str(out / "ckpt"), "save_interval": 1,
                           "train_iters": iters},
        rl_config={"n_samples_per_prompt": 2, "verifier_function": ["test_video_token_share"], "verifier_modules": OMIT,
                   "verifier_parallel": 0, "init_kl_coef": 0.01, "max_prompt_length": 160, "device": OMIT,
                   "kl_penalty": "low_var_kl", "is_multimodal": True, "mini_batch_size": 2, **(rl or {})},
        generate_config={"max_num_seqs": max_num_seqs, "limit_mm_image_per_prompt": 1, "limit_mm_video_per_prompt": 1,
                         "max_model_len": 256, "sampling_config": {"max_tokens": 6, "temperature": 1.0, "top_k": -1}},
        actor_config=actor_config or {})


@pytest.fixture(scope="module")
def video_run(tiny_vlm_dir, video_data, tmp_path_factory):
    """2 GRPO iterations on the video prompts, a checkpoint each."""
    from posttrain.commands.train import train_config as train

    out = tmp_path_factory.mktemp("video_run")
    train(video_config(tiny_vlm_dir, video_data, out))
    return out


def test_grpo_trains_on_video_prompts(tiny_vlm_dir, video_data, video_run):
    from transformers import AutoModelForImageTextToText

    from posttrain.data.builders import build_prompt_dataset
    from tests.helpers.runs import metrics_by_iteration

    metrics = metrics_by_iteration(video_run / "run")
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean", "grpo/score/mean"):
            assert math.isfinite(row[key]), (key, row[key])
    # each video (4 frames of 56x56: t 2 x 4 x 4 patches) fills 8 tokens where 1 pad is stored, an image 4
    stored = [len(item["prompts"]) for item in build_prompt_dataset(video_data, 512, images_per_prompt=1,
                                                                     videos_per_prompt=1)]
    assert metrics[1]["prompt_length/mean"] == pytest.approx(sum(stored) / 4 + 7 + 3 / 4)
    after = AutoModelForImageTextToText.from_pretrained(video_run / "ckpt" / "iter_0000002").state_dict()
    before = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("visual" in k for k in changed) and any("language_model" in k for k in changed)


def test_grpo_reuses_the_video_embeddings(tiny_vlm_dir, video_data, tmp_path, monkeypatch):
    """reuse_image_embeds with videos (frozen tower, 1 iteration): the tower runs only in the
    image_embeds phase, on each sample's images and videos, and every metric equals the same run that
    runs the tower in every pass."""
    import posttrain.loops.multimodal  # noqa: F401  (imported first: its image_embeds phase keeps the real tower call)
    import posttrain.training.multimodal as forward
    from posttrain.commands.train import train_config as train

    real, towers = forward.image_embeds, []  # towers: the vision tower run by a log-prob pass or the update

    def counted(*args, **kwargs):
        towers.append(kwargs.get("videos", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(forward, "image_embeds", counted)
    runs = {}
    for reuse in (True, False):
        rl = {"freeze_vision_tower": True, "reuse_image_embeds": reuse, "guarantee_order": True}  # (the dock draws no rows)
        runs[reuse] = train(video_config(tiny_vlm_dir, video_data, tmp_path / str(reuse), iters=1, rl=rl))
        assert (towers == []) == reuse and (reuse or True in towers)  # recomputed: the videos' tower too
    assert "timing/image_embeds" in runs[True]
    for key in (k for k in runs[False] if not k.startswith("timing/") and not k.endswith("_tps") and k != "time"):
        assert runs[True][key] == pytest.approx(runs[False][key], rel=1e-5, abs=1e-7), key


class Killed(Exception):
    """The run dies here (as under a kill)."""


def test_a_resumed_video_run_repeats_the_straight_one(tiny_vlm_dir, video_data, video_run, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from posttrain.commands.train import train_config as train
    from posttrain.loops.onpolicy import OnPolicyTrainer
    from tests.helpers.runs import metrics_by_iteration

    real = OnPolicyTrainer.train_step

    def dies_at_iteration_2(self, iteration):
        if iteration == 2:
            raise Killed
        return real(self, iteration)

    monkeypatch.setattr(OnPolicyTrainer, "train_step", dies_at_iteration_2)
    with pytest.raises(Killed):  # dies after saving iteration 1
        train(video_config(tiny_vlm_dir, video_data, tmp_path))
    monkeypatch.undo()
    train(video_config(tiny_vlm_dir, video_data, tmp_path, actor_config={"load": str(tmp_path / "ckpt")}))
    a, b = metrics_by_iteration(video_run / "run"), metrics_by_iteration(tmp_path / "run")
    for k in (k for k in a[2] if not k.startswith("timing/") and not k.endswith("_tps") and k != "time"):
        assert b[2][k] == pytest.approx(a[2][k], rel=1e-5, abs=1e-7), k
    x = load_file(video_run / "ckpt" / "iter_0000002" / "model.safetensors")
    y = load_file(tmp_path / "ckpt" / "iter_0000002" / "model.safetensors")
    for k in x:
        torch.testing.assert_close(y[k], x[k], rtol=0, atol=1e-6)


def test_videos_are_limited(video_data):
    from posttrain.data.builders import build_prompt_dataset
    from posttrain.errors import DataError

    item = build_prompt_dataset(video_data, 512, images_per_prompt=1, videos_per_prompt=1)[3]
    assert len(item["images"]) == 1 and [len(v) for v in item["videos"]] == [4]
    with pytest.raises(DataError, match="prompt 0 holds 1 video.*limit_mm_video_per_prompt=0"):
        build_prompt_dataset(video_data, 512, images_per_prompt=1, videos_per_prompt=0)[0]


def test_grpo_trains_on_qwen3_vl_video_prompts(tiny_qwen3_vl_dir, video_data, qwen3, tmp_path):
    """One GRPO iteration of the tiny Qwen3-VL on the video prompts: finite metrics, the prompts
    expanded with their timestamps (the processor's layout, as encode_images builds it)."""
    from posttrain.commands.train import train_config as train
    from posttrain.data.builders import build_prompt_dataset

    model, processor = qwen3
    metrics = train(video_config(tiny_qwen3_vl_dir, video_data, tmp_path, iters=1))
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "grpo/score/mean"):
        assert math.isfinite(metrics[key]), key
    items = build_prompt_dataset(video_data, 512, images_per_prompt=1, videos_per_prompt=1)
    lengths = [len(prompt_ids(processor, model, processor.tokenizer.decode(it["prompts"]), it["images"],
                              it["videos"])["input_ids"]) for it in (items[k] for k in range(4))]
    assert all(length > len(items[0]["prompts"]) + 8 for length in lengths)  # 2 patches: times and blocks
    assert metrics["prompt_length/mean"] == pytest.approx(sum(lengths) / 4)


@pytest.mark.parametrize("mode", ["partial", "async"])
def test_partial_and_async_rollout_sample_with_the_videos(mode, vlm, tiny_vlm_dir, video_data, tmp_path, monkeypatch):
    """Partial rollout (rounds of 3 of the 6 tokens; max_num_seqs 4, so a continued sample is
    re-prefilled: a cut sample's continuation gets its prompt's video and image cells) and
    asynchronous rollout (iteration 2 learns from samples drawn a version behind): with lr 1e-20 every
    sampled token's rollout log-prob equals the sample's own Hugging Face forward with its video (the
    vision tokens left out, as the engine never samples them)."""
    from posttrain.commands.train import train_config as train
    from posttrain.loops.onpolicy import OnPolicyTrainer
    from posttrain.loops.partial_rollout import PartialRollout
    from posttrain.models.vlm import MM_KEYS
    from posttrain.rollout.images import vision_token_ids

    samples, continued = [], []
    real_correct, real_media = OnPolicyTrainer.correct, PartialRollout.row_images

    def correct(self, td, acc, iteration):  # the dock after the old log-prob pass
        samples.extend({"prompt": td.cell("prompts", r), "response": td.cell("responses", r),
                        "rollout": td.cell("rollout_logprobs", r), "media": {k: td.cell(k, r) for k in MM_KEYS}}
                       for r in range(td.max_len))
        return real_correct(self, td, acc, iteration)

    def row_images(self, rows):
        media = real_media(self, rows)
        continued.extend(r for k, r in enumerate(rows) if self.dock.cell("responses", r).numel()
                         and media["images"][k]["video_grid_thw"].shape[0])
        return media

    monkeypatch.setattr(OnPolicyTrainer, "correct", correct)
    monkeypatch.setattr(PartialRollout, "row_images", row_images)
    if mode == "partial":
        train(video_config(tiny_vlm_dir, video_data, tmp_path, iters=1, lr=1e-20, rl={"partial_rollout_max_split": 2},
                           max_num_seqs=4))
        assert continued, "no sample with a video was cut and continued"
    else:
        train(video_config(tiny_vlm_dir, video_data, tmp_path, lr=1e-20, rl={"async_staleness": 1}))
        from tests.helpers.runs import metrics_by_iteration

        assert metrics_by_iteration(tmp_path / "run")[2]["rollout/staleness_max"] == 1
    model, never = vlm[0], vision_token_ids(vlm[0])
    for sample in samples:
        sample["media"]["image_grid_thw"] = sample["media"]["image_grid_thw"].long()
        sample["media"]["video_grid_thw"] = sample["media"]["video_grid_thw"].long()
        want = reference_logprobs(model, sample, never)
        assert torch.allclose(sample["rollout"], want, atol=1e-4), (sample["rollout"] - want).abs().max()
    assert len(samples) == (8 if mode == "partial" else 16)
