"""The GPU device check's measurements (``benchmarks/gpu/device_check.sh`` runs it after the
``gpu``-marked tests). Each section runs on its own: one that fails records its error and the
others still run. Results go to ``OUT/device_check.json`` and ``OUT/device_check.md``.

Sections:

* ``peak``: the bf16 (and fp32) matmul peak measured on the spot (``posttrain.commands.bench.matmul_peak``).
* ``rollout``: 8 prompts x 8 samples x 512 new tokens (every row runs to 512: no EOS) on a random-init
  model shaped like Qwen2.5-0.5B. Hugging Face ``generate`` on a bf16 copy of the model against the
  native engine (bf16 copy, static KV cache) eager and with CUDA graphs (``enforce_eager: false``);
  tokens/s of each and the ratios. The HF and eager runs are timed after a short warm-up call,
  the graph run on its second full call (the first compiles).
* ``logprobs``: (a) the rollout's log-probs against the trainer's teacher-forced ones for the same
  tokens (fp32 master weights under bf16 autocast, :func:`posttrain.training.forward.response_logprobs`);
  (b) the same fp32 weights on the CPU and on the GPU (TF32 off): the largest log-prob difference.
* ``grpo``: ``posttrain bench`` (the real trainer: rollout, the ``format`` rule reward, advantages,
  update; a random model earns no reward, which changes no FLOP of the update) for 1 warm-up
  and 3 measured GRPO iterations on that model in bf16: rollout and update tokens/s, MFU per phase,
  peak memory. ``--with-7b`` adds one iteration shaped like Qwen2.5-7B (off by default: its fp32
  weights, gradients and AdamW state alone need about 122 GB).

MFU = useful model FLOPs of the phase / the phase's seconds / the bf16 matmul peak, with FLOPs from
:func:`posttrain.commands.bench.iteration_flops`: ``2 x matmul weights x tokens`` plus the causal
attention term, the prompt counted once per group, and the update as 3 forward passes.

``--dry-run`` runs the same sections on the CPU with a tiny model and a tiny workload (fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

SHAPES = {  # Hugging Face Qwen2 configs
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
WORKLOADS = {  # prompts, samples per prompt, prompt tokens, new tokens
    "gpu": dict(prompts=8, n=8, prompt_len=50, max_tokens=512),
    "dry": dict(prompts=2, n=2, prompt_len=8, max_tokens=16),
}
PAD, EOS = 0, 1


def build_model(shape: str, device: str, seed: int = 0):
    """A random-init Qwen2 of ``shape`` with fp32 weights (the trainer's master weights) on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(max_position_embeddings=4096, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS,
                      attn_implementation="sdpa", **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM(cfg).float()


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (count, length), generator=g).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn, repeats: int = 1):
    """``fn()``'s result and its best time over ``repeats`` calls."""
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return result, best


# ---- sections ---------------------------------------------------------------------------------------
def section_peak(device: str, dry: bool) -> dict:
    from posttrain.commands.bench import matmul_peak

    size = 512 if dry else 8192
    out = {"fp32_tflops": matmul_peak("float32", device, size=size) / 1e12}
    if not dry:
        out["bf16_tflops"] = matmul_peak("bfloat16", device, size=size) / 1e12
    return out


def section_rollout(model, device: str, work: dict, dry: bool) -> dict:
    import copy

    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.native import NativeEngine

    dtype = "float32" if dry else "bfloat16"
    prompts = random_prompts(work["prompts"], work["prompt_len"], model.config.vocab_size)
    rows, new = work["prompts"] * work["n"], work["max_tokens"]
    sampling = SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, max_tokens=new, seed=0)
    out = {"rows": rows, "new_tokens": new, "dtype": dtype}
    repeats = 3 if dry else 1  # the tiny workload takes milliseconds: keep the best of a few

    # Hugging Face generate on a copy in the rollout dtype (what a user of HF would sample with)
    hf_model = copy.deepcopy(model).to(torch.float32 if dry else torch.bfloat16).eval()
    ids = torch.tensor(prompts, device=device)

    def hf(tokens):
        with torch.inference_mode():
            return hf_model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     num_return_sequences=work["n"], max_new_tokens=tokens, min_new_tokens=tokens,
                                     pad_token_id=PAD, eos_token_id=None)

    hf(4)
    _, seconds = timed(device, lambda: hf(new), repeats)
    out["hf_generate_tps"] = rows * new / seconds
    del hf_model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    def native(**kw):
        return NativeEngine(model, pad_token_id=PAD, eos_token_ids=[EOS], max_num_seqs=rows,
                            max_num_batched_tokens=8192, dtype=dtype, **kw)

    eager = native(static_cache=True)
    eager.generate(prompts, work["n"], SamplingParams(temperature=1.0, top_k=-1, max_tokens=4, seed=1))
    outs, seconds = timed(device, lambda: eager.generate(prompts, work["n"], sampling), repeats)
    tokens = sum(len(o.token_ids) for g in outs for o in g)
    out["native_eager_tps"] = tokens / seconds
    out["native_mean_response"] = tokens / rows
    if device.startswith("cuda"):
        graphs = native(cuda_graphs=True)
        _, compile_seconds = timed(device, lambda: graphs.generate(prompts, work["n"], sampling))
        outs, seconds = timed(device, lambda: graphs.generate(prompts, work["n"], sampling))
        out["native_graphs_tps"] = sum(len(o.token_ids) for g in outs for o in g) / seconds
        out["native_graphs_first_call_s"] = compile_seconds
    best = max(out.get("native_graphs_tps", 0.0), out["native_eager_tps"])
    out["native_over_hf"] = best / out["hf_generate_tps"]
    return out, outs, prompts


def teacher_forced(model, prompts, outs, device: str, autocast: torch.dtype | None) -> torch.Tensor:
    """The trainer's log-probs of the sampled tokens: one row per sample, the trainer's padded layout."""
    from posttrain.training.forward import response_logprobs

    seqs = [(p, o.token_ids) for p, group in zip(prompts, outs) for o in group]
    width = max(len(r) for _, r in seqs)
    input_ids = torch.tensor([p + r + [PAD] * (width - len(r)) for p, r in seqs], device=device)
    mask = torch.tensor([[1] * (len(p) + len(r)) + [0] * (width - len(r)) for p, r in seqs], device=device)
    batch = {"input_ids": input_ids, "attention_mask": mask, "response_mask": mask[:, -width:].float()}
    context = torch.autocast(device.split(":")[0], dtype=autocast) if autocast else torch.no_grad()
    with torch.no_grad(), context:
        logprobs, _ = response_logprobs(model, batch, temperature=1.0)
    return logprobs, batch["response_mask"]


def section_logprobs(model, prompts, outs, device: str, dry: bool) -> dict:
    import copy
    import dataclasses

    out = {}
    few = [g[:2] for g in outs[:2]]  # 4 samples: enough for the statistics, cheap on the CPU below
    trainer, mask = teacher_forced(model, prompts[:2], few, device, None if dry else torch.bfloat16)
    width = mask.shape[1]
    rollout = torch.tensor([o.logprobs + [0.0] * (width - len(o.logprobs)) for g in few for o in g], device=device)
    diff = (rollout - trainer).abs()[mask.bool()]
    out["rollout_vs_trainer_mean"] = float(diff.mean())
    out["rollout_vs_trainer_max"] = float(diff.max())

    # the same fp32 weights on the CPU and on this device (TF32 off): teacher-forced log-probs
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        # one sample per prompt, 64 response tokens: enough, and a short forward on the CPU
        short = [[dataclasses.replace(g[0], token_ids=g[0].token_ids[:64])] for g in few]
        here, mask = teacher_forced(model, prompts[:2], short, device, None)
        cpu_model = model if device == "cpu" else copy.deepcopy(model).to("cpu")
        there, _ = teacher_forced(cpu_model, prompts[:2], short, "cpu", None)
        del cpu_model
        out["cpu_vs_device_fp32_max"] = float((here.cpu() - there).abs()[mask.cpu().bool()].max())
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return out


def write_run_inputs(model, root: Path, work: dict, seed: int = 0) -> tuple[Path, Path]:
    """A model directory (weights, config and a word-level tokenizer covering the whole vocabulary)
    and a prompt dataset of random tokens: what ``posttrain bench`` reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from posttrain.data.preprocess import write_token_rows

    vocab = {"<pad>": PAD, "<eos>": EOS} | {f"t{i}": i for i in range(2, model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<pad>")
    model_dir = root / "model"
    model.save_pretrained(model_dir, safe_serialization=True)
    fast.save_pretrained(model_dir)
    prompts = random_prompts(64, work["prompt_len"], model.config.vocab_size, seed=seed + 1)
    data = root / "data" / "prompts"
    write_token_rows(data, {"input_ids": prompts, "attention_mask": [[1] * len(p) for p in prompts],
                            "labels": [[p[0]] for p in prompts]})
    return model_dir, data


def section_grpo(shape: str, model_dir: Path, data: Path, work: dict, dry: bool, iters: int, warmup: int) -> dict:
    from posttrain.commands.bench import bench
    from posttrain.config.run import load_run_config
    from posttrain.paths import configs_dir

    gbs, n, new, prompt_len = work["prompts"], work["n"], work["max_tokens"], work["prompt_len"]
    overrides = [
        f"megatron_training.tokenizer_name_or_path={model_dir}", f"megatron_training.data_path={data}",
        "megatron_training.prompt_type=tiny_math", f"megatron_training.prompt_type_path={configs_dir() / 'tiny_templates.json'}",
        f"megatron_training.seq_length={prompt_len + new + 1}", f"megatron_training.global_batch_size={gbs}",
        f"megatron_training.bf16={'false' if dry else 'true'}", "megatron_training.save_interval=0",
        f"actor_config.load={model_dir}", "actor_config.finetune=true", "actor_config.save=null",
        f"actor_config.micro_batch_size={min(gbs * n, 16)}", "actor_config.lr=1e-6",
        f"rl_config.n_samples_per_prompt={n}", f"rl_config.mini_batch_size={gbs}",
        f"rl_config.max_prompt_length={prompt_len + 1}", "rl_config.verifier_function=[format]",
        "rl_config.verifier_weight=[1.0]", "rl_config.eval_data_path=null", "rl_config.use_tensorboard=false",
        f"rl_config.output_dir={model_dir.parent / 'grpo'}",
        f"generate_config.max_model_len={prompt_len + new + 1}", f"generate_config.max_num_seqs={gbs * n}",
        f"generate_config.dtype={'float32' if dry else 'bfloat16'}",
        f"generate_config.sampling_config.max_tokens={new}", "generate_config.sampling_config.temperature=1.0",
    ]
    if not dry:
        overrides.append("generate_config.enforce_eager=false")  # CUDA graphs
    cfg = load_run_config("grpo_tiny_qwen2", None, overrides)
    report = bench(cfg, iters=iters, warmup=warmup)
    s = report["summary"]
    med = {k: v["median"] for k, v in s.items()}
    rows = gbs * n
    tokens = rows * (prompt_len + med.get("response_length/mean", new))
    return {
        "shape": shape, "device": report["device"], "train_dtype": report["train_dtype"],
        "rollout_dtype": report["rollout_dtype"],
        "num_params": report["num_params"], "iters": report["iters"], "warmup": report["warmup"],
        "step_s": med.get("timing/all"), "rollout_s": med.get("timing/rollout"), "update_s": med.get("timing/update"),
        "rollout_tps": med.get("rollout_response_tps"),
        "update_tps": tokens / med["timing/update"] if med.get("timing/update") else None,
        "seed_update_tps": med.get("update_tps"), "mfu_rollout": med.get("mfu/rollout"),
        "mfu_update": med.get("mfu/update"), "mfu_all": med.get("mfu/all"),
        "matmul_peak_tflops": report["matmul_peak_gflops"] / 1e3, "peak_memory_mib": report["peak_memory_mib"],
        "step_over_floor": report["step_over_floor"],
    }


# ---- the report -------------------------------------------------------------------------------------
def run_section(results: dict, name: str, fn):
    print(f"== {name}", flush=True)
    start = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # one failing section must not hide the others' numbers
        results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000],
                         "traceback": traceback.format_exc()[-4000:]}
        print(results[name]["traceback"], file=sys.stderr, flush=True)
        value = None
    else:
        results[name] = value[0] if isinstance(value, tuple) else value
    results[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(results[name], default=str)[:1500], flush=True)
    return value


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"# posttrain device check ({'dry run, ' if env['dry_run'] else ''}{env['device_name']})", "",
             f"torch {env['torch']}, transformers {env['transformers']}, {env['date']}", "",
             "| section | measure | value |", "|---|---|---|"]
    for section, values in results.items():
        if section == "environment":
            continue
        for key, value in values.items():
            if key == "traceback":
                continue
            shown = f"{value:.4g}" if isinstance(value, float) else str(value).replace("|", "/")[:200]
            lines.append(f"| {section} | {key} | {shown} |")
    targets = results.get("rollout", {}).get("native_over_hf"), results.get("grpo", {}).get("mfu_update")
    lines += ["", f"Targets: rollout >= 3x HF generate: {targets[0] and round(targets[0], 2)}; "
                  f"update MFU > 30%: {targets[1] and round(100 * targets[1], 1)}%."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/device_check")
    parser.add_argument("--dry-run", action="store_true", help="the same sections on the CPU, tiny model")
    parser.add_argument("--with-7b", action="store_true", help="add one GRPO iteration shaped like Qwen2.5-7B")
    parser.add_argument("--tests", default=None, help="the gpu tests' junit XML, summarised in the report")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    import transformers

    results: dict = {"environment": {
        "dry_run": dry, "device_name": torch.cuda.get_device_name() if not dry else platform.processor() or "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
    if args.tests and Path(args.tests).is_file():
        results["gpu_tests"] = junit_summary(Path(args.tests))
    work = WORKLOADS["dry" if dry else "gpu"]
    shape = "tiny" if dry else "qwen2.5-0.5b"
    run_section(results, "peak", lambda: section_peak(device, dry))
    model = build_model(shape, device)
    rollout = run_section(results, "rollout", lambda: section_rollout(model, device, work, dry))
    if rollout is not None:
        _, outs, prompts = rollout
        run_section(results, "logprobs", lambda: section_logprobs(model, prompts, outs, device, dry))
    work_dir = Path(tempfile.mkdtemp(prefix="posttrain_device_check_"))  # model files: not in OUT (sent back)
    inputs = run_section(results, "inputs", lambda: ({"shape": shape}, *write_run_inputs(model, work_dir, work)))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    if inputs is not None:
        _, model_dir, data = inputs
        run_section(results, "grpo", lambda: section_grpo(shape, model_dir, data, work, dry, iters=3, warmup=1))
    if args.with_7b and not dry:
        def seven():
            big = build_model("qwen2.5-7b", "cpu")
            model_dir, data = write_run_inputs(big, work_dir / "7b", work)
            del big
            return section_grpo("qwen2.5-7b", model_dir, data, work, dry, iters=1, warmup=0)

        run_section(results, "grpo_7b", seven)
    shutil.rmtree(work_dir, ignore_errors=True)
    from posttrain.files import write_text_atomic

    write_text_atomic(out / "device_check.json", json.dumps(results, indent=1, default=str))
    write_text_atomic(out / "device_check.md", markdown(results))
    print((out / "device_check.md").read_text())
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


def junit_summary(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return counts | {"failed": failed}


if __name__ == "__main__":
    sys.exit(main())
