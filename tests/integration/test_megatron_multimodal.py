"""Qwen2.5-VL on the megatron backend (posttrain.training.megatron.vision): the language model as
Megatron-Core's GPTModel with multimodal rotary positions, the Hugging Face vision tower frozen
beside it, on 2 gloo ranks (one spawn for every check, to keep the suite short):

* its log-probs of a packed and of a padded batch (two image rows of different sizes and a
  text-only row), in one micro-batch or one a row, equal each sample's own Hugging Face forward
  (fp32: 1e-5 at TP 1, 1e-4 at TP 2);
  the images matter (row 0 with its patches reversed: other log-probs);
* at TP 2, one GRPO update (Adam, clipped ratio and gradient norm) with the images equals the hf
  backend's (TrainEngine) with a frozen tower: the step's metrics, the next log-probs; and the
  trained language model saved with the Hugging Face VLM (``save_vlm``) is a Qwen2.5-VL directory
  that ``AutoModelForImageTextToText`` and ``load_processor`` load, with the tower's weights
  unchanged and the hf backend's trained weights and log-probs; the native rollout on that VLM
  samples with the images, and the megatron engine's log-probs of the samples equal the rollout
  copy's own forward's (1e-4);
* the refusals (sequence parallelism, a value head, Qwen3-VL, a trained tower) name the key or file.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_vlm import drawn_image
from tests.megatron.spawn_ranks import run_on_ranks

pytestmark = pytest.mark.slow

LR = 1e-2
SIZES = [(56, 84), None, (84, 56)]  # (width, height) of each row's image; None: a text-only row
RESPONSE_LENGTHS = [5, 3, 7]


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


def grpo_inputs(model, batch) -> dict:
    """``batch`` with old log-probs a little off the model's and random advantages (both clippings at work)."""
    from posttrain.training.engine import TrainEngine

    g = torch.Generator().manual_seed(3)
    mask = batch["response_mask"].float()
    logprobs = TrainEngine(model, micro_batch_size=3).compute_logprobs(batch)
    return {**batch, "old_logprobs": (logprobs + 0.3 * torch.randn(logprobs.shape, generator=g)) * mask,
            "advantages": torch.tensor([[1.0], [-0.5], [0.8]]).expand_as(mask) * mask}


def hf_update(model_dir: str, batch) -> tuple:
    """The hf backend's GRPO step on ``batch`` (frozen tower): its metrics, the next log-probs, the model."""
    from transformers import AutoModelForImageTextToText

    from posttrain.training.engine import TrainEngine
    from posttrain.training.loss_fns import make_actor_loss_fn
    from posttrain.training.multimodal import freeze_vision_tower
    from posttrain.training.optim import build_optimizer
    from posttrain.training.options import ActorLossOptions

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    freeze_vision_tower(model)
    engine = TrainEngine(model, build_optimizer(model, LR, weight_decay=0.0), clip_grad=1.0, micro_batch_size=3)
    [metrics] = engine.update(batch, make_actor_loss_fn(ActorLossOptions()), mini_batch_size=3)
    return metrics, engine.compute_logprobs(batch), model


def megatron_update(model_dir: str, hf, batch, out: str) -> tuple:
    """The megatron engine's GRPO step at TP 2 (the tower frozen, outside Megatron's optimizer); the
    trained language model copied into ``hf`` and saved in ``out`` (rank 0)."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from posttrain.training.loss_fns import make_actor_loss_fn
    from posttrain.training.megatron.engine import MegatronEngine
    from posttrain.training.megatron.model import hf_to_megatron
    from posttrain.training.megatron.vision import VisionInputs
    from posttrain.models.vlm import load_processor
    from posttrain.training.megatron.vlm_weights import save_vlm
    from posttrain.training.options import ActorLossOptions

    [chunk], args = hf_to_megatron(model_dir, for_training=True)
    wrapped = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False), chunk)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=1.0,
                                                       bf16=False), [wrapped])
    engine = MegatronEngine(wrapped, optimizer, vocab_size=hf.config.text_config.vocab_size, micro_batch_size=3,
                            vision=VisionInputs(hf))
    [metrics] = engine.update(batch, make_actor_loss_fn(ActorLossOptions()), mini_batch_size=3)
    after = engine.compute_logprobs(batch)
    saved = save_vlm([chunk], args, hf, out, load_processor(model_dir))
    assert (saved is not None) == (dist.get_rank() == 0)
    dist.barrier()
    return metrics, after, engine


def check_update(model_dir: str, hf, rows: list[dict], batch, out: str) -> None:
    from transformers import AutoModelForImageTextToText

    from posttrain.models.vlm import load_processor
    from posttrain.training.engine import TrainEngine

    tower = {k: v.clone() for k, v in hf.model.visual.state_dict().items()}
    batch = grpo_inputs(hf, batch)
    want, want_after, want_model = hf_update(model_dir, batch)
    got, got_after, engine = megatron_update(model_dir, hf, batch, out)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (key, got, want)
    assert want["actor/pg_clipfrac"] > 0 and want["actor/grad_norm"] > 1, want
    torch.testing.assert_close(got_after, want_after, rtol=0, atol=1e-4)
    saved = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert load_processor(out).image_processor.merge_size == 2  # the processor saved beside it
    for name, value in saved.model.visual.state_dict().items():
        torch.testing.assert_close(value, tower[name], rtol=0, atol=0, msg=name)
    trained = dict(want_model.named_parameters())
    for name, value in saved.named_parameters():
        if "visual" not in name:  # Adam's first step moves each weight by about lr: a wrong layout by far more
            assert (value - trained[name]).abs().max() <= 0.2 * LR, name
    assert (saved.lm_head.weight - hf.lm_head.weight).abs().max() == 0
    torch.testing.assert_close(TrainEngine(saved, micro_batch_size=3).compute_logprobs(batch), want_after,
                               rtol=0, atol=1e-4)
    check_sampled(hf, engine, rows)


def check_sampled(hf, engine, rows: list[dict]) -> None:
    """The rollout (the native engine on ``hf``, the VLM the trained language model was copied into)
    samples 2 responses to each prompt of ``rows`` with its image; the megatron engine's log-probs
    of those samples equal the rollout copy's own forward's (what the hf backend's trainer
    computes), 1e-4."""
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine
    from posttrain.training.engine import TrainEngine

    images = [{k: r["image"][k] for k in ("pixel_values", "image_grid_thw")} if r["image"]["image_grid_thw"].shape[0]
              else None for r in rows]
    outs = NativeEngine(hf, pad_token_id=0, eos_token_ids=[]).generate(
        [r["prompt"].tolist() for r in rows], 2, SamplingParams(temperature=1.0, top_k=-1, max_tokens=4, seed=7),
        images=images)
    sampled = megatron_batch(hf, [{**r, "response": torch.tensor(o.token_ids)} for r, group in zip(rows, outs)
                                  for o in group])
    torch.testing.assert_close(engine.compute_logprobs(sampled),
                               TrainEngine(hf, micro_batch_size=6).compute_logprobs(sampled), rtol=0, atol=1e-4)


def worker(rank: int, model_dir: str, out: str) -> None:
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForImageTextToText

    from posttrain.errors import ConfigError
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
            with pytest.raises(ConfigError, match="sequence_parallel: false"):
                hf_to_megatron(model_dir, sequence_parallel=True)
            with pytest.raises(ConfigError, match="no critic or reward head"):
                hf_to_megatron(model_dir, value_head=True)
            [chunk], _ = hf_to_megatron(model_dir)
            for packed in (True, False):
                # one micro-batch of all 3 rows, or one a row (the text-only row's alone: its plain positions)
                rows_each = 3 if packed == (tp == 2) else 1
                engine = MegatronEngine(chunk, vocab_size=hf.config.text_config.vocab_size, micro_batch_size=rows_each,
                                        options=EngineOptions(use_remove_padding=packed), vision=VisionInputs(hf))
                got = engine.compute_logprobs(batch)
                for row, ref in enumerate(want):
                    torch.testing.assert_close(got[row, :ref.numel()], ref, rtol=0, atol=atol,
                                               msg=f"TP {tp}, packed {packed}, {rows_each} a micro-batch, row {row}")
                    assert torch.all(got[row, ref.numel():] == 0)
            # the images matter: row 0's patches in another order give other log-probs
            image = rows[0]["image"]
            reversed_patches = {**image, "pixel_values": image["pixel_values"].flip(0)}
            flipped = megatron_batch(hf, [{**rows[0], "image": reversed_patches}])
            other = engine.compute_logprobs(flipped)[0, :want[0].numel()]
            assert (other - want[0]).abs().max() > 10 * atol
            if tp == 2:
                check_update(model_dir, hf, rows, batch, out)
            ps.destroy_model_parallel()


def test_megatron_vlm_logprobs_and_update_equal_the_hf_backend(tiny_vlm_dir, tmp_path):
    run_on_ranks(worker, str(tiny_vlm_dir), str(tmp_path / "saved"), out=tmp_path)


def test_what_the_megatron_vlm_refuses_and_the_language_model_names(tiny_vlm_dir, tmp_path):
    """Qwen3-VL and a rotary split that does not fill the head are refused naming the file; a trained
    tower is refused naming the key; weights named ``model.language_model.*`` read as the text model's."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    from posttrain.errors import ConfigError
    from posttrain.models.mcore.hf_files import HFWeights
    from posttrain.training.megatron.vision import LanguageModelWeights, VisionInputs, mrope_section

    assert mrope_section(tiny_vlm_dir) == [4, 6, 6]  # the tiny model's split of its 32-dim heads
    config = json.loads((tiny_vlm_dir / "config.json").read_text())
    for change, refusal in (({"model_type": "qwen3_vl"}, "model_type 'qwen3_vl'"),
                            ({"text_config": {**config["text_config"], "rope_parameters": {
                                "rope_type": "default", "mrope_section": [4, 6, 4]}}}, "must add up to half")):
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=refusal) as err:
            mrope_section(tmp_path)
        assert str(tmp_path / "config.json") in str(err.value)
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_dir), dtype=torch.float32)
    with pytest.raises(ConfigError, match="freeze_vision_tower: true"):
        VisionInputs(model)  # the tower trains (requires_grad)
    save_file({"model.language_model.layers.0.mlp.down_proj.weight": torch.arange(6.0).view(2, 3),
               "lm_head.weight": torch.ones(2, 2)}, str(tmp_path / "model.safetensors"))
    weights = LanguageModelWeights(HFWeights(tmp_path))
    assert sorted(weights.names()) == ["lm_head.weight", "model.layers.0.mlp.down_proj.weight"]
    assert weights.cols("model.layers.0.mlp.down_proj.weight", 1, 3).tolist() == [[1.0, 2.0], [4.0, 5.0]]
    assert weights.shape("lm_head.weight") == (2, 2)
