"""MEASUREMENT SCRIPT: the vision demo's warm start done by ``posttrain sft`` (multimodal SFT).

The vision demo (``python -m posttrain.demo --task vision``) warm-starts its tiny Qwen2.5-VL with its
own loop, which stops once half of a check set is answered right. This script does the same SFT
through the product instead (``stage: sft``, ``rl_config.is_multimodal: true``, docs/multimodal.md):
the demo's 2000 training pictures as prompt + ``\\boxed{N}`` + image rows, preprocessed with
``AlpacaStyleInstructionHandler``, 32 pictures a step, AdamW lr 5e-4 (constant), a checkpoint every
``--save-every`` steps. It prints the demo's check accuracy (the most likely count token after
``\\boxed{`` on 128 training pictures) of every checkpoint and the held-out greedy accuracy of the
last one::

    python examples/demo/vision_sft.py --seed 1 --steps 140 --out runs/vision_sft
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=140)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("runs/vision_sft"))
    return p.parse_args(argv)


def sft_data(out: Path, seed: int):
    """The demo's splits; the train split as SFT rows, preprocessed. Returns (train, test, prefix)."""
    from posttrain.data.preprocess import preprocess
    from posttrain.demo.vision_task import IMAGE_SIZE, make_vision_splits, sft_response, write_split

    train, test = make_vision_splits(2000, 200, seed, IMAGE_SIZE)
    raw = write_split(train, out / "raw" / "train.jsonl", "train", IMAGE_SIZE)
    rows = [json.loads(line) for line in raw.read_text().splitlines()]
    (out / "raw" / "sft.jsonl").write_text("".join(json.dumps({**r, "response": sft_response(r["answer"])}) + "\n"
                                                   for r in rows))
    preprocess({"input": str(out / "raw" / "sft.jsonl"), "handler_name": "AlpacaStyleInstructionHandler",
                "tokenizer_name_or_path": str(out / "model_init"), "prompt_type": "qwen2_vl",
                "map_keys": {"prompt": "prompt", "response": "response"}, "output_prefix": str(out / "data" / "sft"),
                "workers": 1}, progress=False)
    return train, test, str(out / "data" / "sft")


def sft_config(out: Path, data: str, seed: int, steps: int, save_every: int):
    from posttrain.config.run import run_config_from_dict

    return run_config_from_dict({
        "megatron_training": {"stage": "sft", "tokenizer_name_or_path": str(out / "model_init"), "data_path": data,
                              "prompt_type": "qwen2_vl", "global_batch_size": 32, "micro_batch_size": 16,
                              "seq_length": 256, "train_iters": steps, "lr": 5e-4, "lr_decay_style": "constant",
                              "weight_decay": 0.0, "clip_grad": 1.0, "seed": seed, "bf16": False,
                              "save": str(out / "ckpt"), "save_interval": save_every},
        "rl_config": {"is_multimodal": True, "output_dir": str(out / "run"), "device": "cpu"}}, name="vision_sft")


def main(argv=None) -> int:
    from posttrain.commands.init_model import init_model
    from posttrain.commands.train import train_config
    from posttrain.demo.vision_sft import answer_accuracy, chat_prompt, greedy_accuracy, load_vlm
    from posttrain.demo.vision_task import IMAGE_SIZE, QUESTION

    args = parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    init_model("tiny_qwen25_vl", args.out / "model_init", seed=args.seed)
    train, test, data = sft_data(args.out, args.seed)
    start = time.time()
    train_config(sft_config(args.out, data, args.seed, args.steps, args.save_every))
    print(f"posttrain sft: {args.steps} steps in {time.time() - start:.0f} s")
    checkpoints = sorted((args.out / "ckpt").glob("iter_*"))
    for ckpt in checkpoints:
        model, processor = load_vlm(ckpt)
        accuracy = answer_accuracy(model.eval(), processor, chat_prompt(processor.tokenizer, QUESTION), train[:128],
                                   IMAGE_SIZE)
        print(f"{ckpt.name}: check accuracy {accuracy:.1%}")
    held_out = greedy_accuracy(checkpoints[-1], test, QUESTION, image_size=IMAGE_SIZE)
    print(f"{checkpoints[-1].name}: held-out greedy accuracy strict {held_out['accuracy']:.1%}, "
          f"lenient {held_out['lenient_accuracy']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
