"""One TRL GRPOTrainer run on the shared setup (common.py); writes per-step records as JSON.

    python benchmarks/vs_trl/run_trl.py --work /tmp/perf/work --size tiny --steps 4 --threads 2 --out trl.json

fp32 (``bf16=False``; ``--precision bf16``: ``bf16=True``, bf16 autocast), no gradient
checkpointing, no reference model (``beta=0``), loss ``dapo``
(token mean over the batch, as posttrain's ``token-mean``), one optimizer step per 8 x 8
completions, constant learning rate, HF ``generate`` on the CPU. ``--save DIR`` saves the final
model and tokenizer in DIR (for ``learning.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", default="/tmp/perf/work")
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--save", default=None, help="save the final model here")
    p.add_argument("--seed", type=int, default=None, help="the training seed (default: the size's)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: GRPOConfig(bf16=True)")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common import prepare, prompt_texts, settings
    from posttrain.reward.verifiers import VERIFIERS
    from posttrain.commands.bench import CpuMeter

    s = settings(args.size)
    if args.seed is not None:
        s["seed"] = args.seed
    paths = prepare(Path(args.work), args.size)
    pairs = prompt_texts(paths, 4000, s["max_prompt_length"])
    data = Dataset.from_list([{"prompt": prompt, "label": label} for prompt, label in pairs])
    verifier = VERIFIERS.get(s["verifier"]).fn

    def reward(prompts, completions, label, **kwargs):
        return [float(verifier(c, l)) for c, l in zip(completions, label)]

    records: list[dict] = []

    class Timing(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.meter = CpuMeter().__enter__()

        def on_step_end(self, a, state, control, **kw):
            self.meter.__exit__(None, None, None)
            records.append({"step": state.global_step, **{f"cpu/{k}": v for k, v in self.meter.result.items()}})

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and records and "reward" in logs:
                records[-1].update({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(paths["model"], dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(Path(args.out).with_suffix(".trl_out")), max_steps=args.steps,
        per_device_train_batch_size=s["num_prompts"] * s["n"], gradient_accumulation_steps=1,
        num_generations=s["n"], max_completion_length=s["max_tokens"], temperature=s["temperature"],
        top_p=1.0, top_k=0, learning_rate=s["lr"], lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=s["clip_grad"], adam_beta2=s["adam_beta2"], epsilon=s["epsilon"], beta=0.0, loss_type="dapo", scale_rewards="group",
        bf16=args.precision == "bf16", fp16=False, gradient_checkpointing=False, use_cpu=True, seed=s["seed"],
        logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Timing()])
    start = time.time()
    trainer.train()
    if args.save:
        trainer.save_model(args.save)
    for rec in records:  # tokens of this step = difference of TRL's cumulative num_tokens
        rec["tokens"] = rec.get("num_tokens", 0.0)
    prev = 0.0
    for rec in records:
        rec["tokens"], prev = rec["tokens"] - prev, rec["tokens"]
        rec["e2e_tokens_per_s"] = rec["tokens"] / rec["cpu/wall_s"]
    import resource

    out = {"side": "trl", "size": args.size, "threads": args.threads, "total_s": time.time() - start,
           "peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "records": records}
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
