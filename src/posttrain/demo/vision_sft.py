"""The vision demo's warm start and held-out evaluation, on a Hugging Face Qwen2.5-VL directory.

* :func:`warm_start`: supervised fine-tuning on ``(picture, "\\boxed{N}")`` pairs, AdamW in plain
  PyTorch with the model directory's processor, loss on the reply tokens only. It stops early, by
  design, once the answer is right on a target share of training pictures (checked after every
  step): the demo wants a policy that is right about half of the time, for GRPO to improve.
  ``posttrain sft`` trains a VLM on image+text rows too (docs/multimodal.md), but it has no such
  stop, and the demo's measured results (docs/demo.md) were made with this loop, so it stays.
* :func:`greedy_accuracy`: greedy replies (Transformers' ``generate``, independent of the rollout
  engine that GRPO trains with) to held-out pictures, scored strict and lenient
  (:func:`posttrain.demo.vision_task.strict_reward` / ``lenient_reward``).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from posttrain.demo.vision_task import Layout, render, sft_response, strict_reward, lenient_reward

PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                   "special_tokens_map.json")


SYSTEM = "You are a helpful assistant."  # the qwen2_vl template's system turn, which GRPO's prompts hold


def chat_prompt(tokenizer, question: str) -> str:
    """The chat text of the prompt GRPO trains on (``posttrain preprocess`` with ``prompt_type: qwen2_vl``):
    the system turn, a user turn holding one picture (``<image>`` in ``question``) and the question."""
    text = question.replace("<image>", "")
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_vlm(model_dir: str | Path):
    from transformers import AutoModelForImageTextToText

    from posttrain.models.vlm import load_processor

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32), load_processor(model_dir)


def _sft_batch(processor, prompt: str, layouts: list[Layout], image_size: int):
    """The processor's inputs for ``prompt + "\\boxed{N}<|im_end|>"`` per layout, and the labels (-100 on the prompt)."""
    tok = processor.tokenizer
    texts = [prompt + sft_response(str(len(layout))) + "<|im_end|>" for layout in layouts]
    batch = processor(text=texts, images=[render(layout, image_size) for layout in layouts])
    image_tokens = int(batch["image_grid_thw"][0].prod()) // processor.merge ** 2
    prompt_len = len(tok(prompt)["input_ids"]) + image_tokens - 1  # the one pad became image_tokens
    labels = batch["input_ids"].clone()
    labels[:, :prompt_len] = -100
    labels[batch["attention_mask"] == 0] = -100
    return batch, labels


@torch.no_grad()
def answer_accuracy(model, processor, prompt: str, layouts: list[Layout], image_size: int) -> float:
    """The share of ``layouts`` whose count is the model's most likely token after ``prompt + "\\boxed{"``
    (one forward pass: the warm start's cheap stopping test, on pictures of the training split)."""
    tok = processor.tokenizer
    tok.padding_side = "right"
    batch = processor(text=[prompt + "\\boxed{"] * len(layouts), images=[render(x, image_size) for x in layouts])
    logits = model(**batch).logits
    last = batch["attention_mask"].sum(1) - 1
    predicted = logits[torch.arange(len(layouts)), last].argmax(-1).tolist()
    return sum(p == tok.convert_tokens_to_ids(str(len(x))) for p, x in zip(predicted, layouts)) / len(layouts)


def warm_start(model_dir: str | Path, output: str | Path, layouts: list[Layout], question: str, *, max_steps: int,
               target: float, lr: float, batch_size: int, seed: int, image_size: int, check_every: int = 1,
               num_check: int = 128) -> tuple[Path, dict]:
    """SFT on random batches of ``layouts`` (AdamW) until the answer accuracy on ``num_check`` of them
    (:func:`answer_accuracy`, every ``check_every`` steps) reaches ``target``, or ``max_steps``; the
    model and its processor saved to ``output``. Returns the directory and ``{"steps", "check_accuracy"}``."""
    torch.manual_seed(seed)
    model, processor = load_vlm(model_dir)
    prompt = chat_prompt(processor.tokenizer, question)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    check = layouts[:num_check]
    steps, accuracy = 0, 0.0
    while steps < max_steps:
        model.train()
        processor.tokenizer.padding_side = "right"
        batch, labels = _sft_batch(processor, prompt, rng.sample(layouts, min(batch_size, len(layouts))), image_size)
        model(**batch, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if steps % check_every == 0 or steps == max_steps:
            accuracy = answer_accuracy(model.eval(), processor, prompt, check, image_size)
            if accuracy >= target:
                break
    output = Path(output)
    model.eval().save_pretrained(output)
    for name in PROCESSOR_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copy(Path(model_dir) / name, output / name)
    return output, {"steps": steps, "check_accuracy": accuracy}


@torch.no_grad()
def greedy_accuracy(model_dir: str | Path, layouts: list[Layout], question: str, *, image_size: int,
                    max_new_tokens: int = 8, batch_size: int = 50) -> dict[str, float]:
    """Greedy held-out accuracy of the model in ``model_dir``: ``accuracy`` (strict) and ``lenient_accuracy``."""
    model, processor = load_vlm(model_dir)
    tok = processor.tokenizer
    tok.padding_side = "left"
    prompt = chat_prompt(tok, question)
    strict = lenient = 0.0
    for start in range(0, len(layouts), batch_size):
        chunk = layouts[start:start + batch_size]
        batch = processor(text=[prompt] * len(chunk), images=[render(layout, image_size) for layout in chunk])
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
        replies = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        for reply, layout in zip(replies, chunk):
            strict += strict_reward(reply, str(len(layout)))
            lenient += lenient_reward(reply, str(len(layout)))
    return {"accuracy": strict / len(layouts), "lenient_accuracy": lenient / len(layouts)}
