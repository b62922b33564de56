"""``posttrain eval``: generate on held-out prompts and score them with verifiers.

The data is a preprocessed prompt dataset prefix (with ``labels``), or a JSONL file of
``{"problem": ..., "answer": ...}`` rows (also ``prompt``/``question`` and ``label``/``solution``)
rendered with ``--prompt-type`` (default: the tokenizer's own chat template).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from posttrain.checkpoint import check_model_files
from posttrain.commands.outputs import check_output_file, write_text_atomic
from posttrain.data.datasets import PromptDataset
from posttrain.data.encoding import TemplateEncoder
from posttrain.data.readers import iter_jsonl
from posttrain.data.templates import get_template
from posttrain.device import resolve_device
from posttrain.errors import ConfigError, DataError
from posttrain.loops.evaluate import evaluate
from posttrain.models.cpu_linear import resolve_cpu_linear, use_cpu_linear
from posttrain.models.loading import check_vocab, load_tokenizer, resolve_model
from posttrain.models.lora import load_merged
from posttrain.reward.decoding import decode_labels
from posttrain.reward.rule_reward import RuleReward
from posttrain.reward.verifiers import VERIFIERS
from posttrain.rollout.base import ROLLOUT_ENGINES, SamplingParams
from posttrain.rollout.native import DTYPES

PROMPT_FIELDS = ("prompt", "problem", "question", "instruction")
LABEL_FIELDS = ("answer", "label", "solution", "output")


def load_jsonl_prompts(path: Path, tokenizer, prompt_type: str | None) -> tuple[list[list[int]], list[str]]:
    encoder = TemplateEncoder(get_template(prompt_type or "hf_chat_template"), tokenizer)
    prompts, labels = [], []
    for row, where in iter_jsonl(path):
        prompt = next((row[k] for k in PROMPT_FIELDS if k in row), None)
        label = next((row[k] for k in LABEL_FIELDS if k in row), None)
        if prompt is None or label is None:
            raise DataError(f"{where}: needs a prompt field ({'/'.join(PROMPT_FIELDS)}) and a label field "
                            f"({'/'.join(LABEL_FIELDS)}); it has {sorted(row)}")
        prompts.append(encoder.encode_prompt(str(prompt)))
        labels.append(str(label))
    return prompts, labels


def load_prompts(data: str, tokenizer, prompt_type: str | None, limit: int | None):
    path = Path(data)
    if path.suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise DataError(f"--data {path}: no such file")
        prompts, labels = load_jsonl_prompts(path, tokenizer, prompt_type)
    else:
        ds = PromptDataset(data, max_prompt_length=None)
        items = [ds[i] for i in range(len(ds))]
        prompts = [[int(t) for t in it["prompts"]] for it in items]
        labels = decode_labels(tokenizer, [[int(t) for t in it["labels"]] for it in items])
    if limit:
        prompts, labels = prompts[:limit], labels[:limit]
    if not prompts:
        raise DataError(f"--data {data}: no prompts")
    return prompts, labels


def run(args) -> int:
    logging.basicConfig(level=logging.WARNING)
    check_args(args)
    force = bool(getattr(args, "force", False))
    samples_path = getattr(args, "samples", None)
    if args.output:  # before the work: an output problem must not cost the whole evaluation
        check_output_file(args.output, "--output", force=force)
    if samples_path:
        check_output_file(samples_path, "--samples", force=force)
    device = resolve_device("auto")
    with use_cpu_linear(resolve_cpu_linear(device)):  # for this command only
        return evaluate_model(args, device, samples_path)


def evaluate_model(args, device: str, samples_path: str | None) -> int:
    """``posttrain eval``'s work once its flags and outputs are checked: print (and write) the scores."""
    path, _ = resolve_model(args.model)
    check_model_files(path)  # a truncated or corrupt file is named, not a loader traceback
    check_max_tokens(path, args.max_tokens)
    tokenizer = load_tokenizer(path)
    model = load_merged(path, device=device)  # a LoRA checkpoint: its adapter merged into the base
    check_vocab(model, tokenizer, str(path))
    prompts, labels = load_prompts(args.data, tokenizer, args.prompt_type, args.limit)
    engine = ROLLOUT_ENGINES.get("native")(model=model, pad_token_id=tokenizer.pad_token_id,
                                           eos_token_ids=[tokenizer.eos_token_id], dtype=args.dtype)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_k=-1, seed=args.seed)
    verifiers = args.verifier or ["math_equiv"]
    torch.manual_seed(args.seed)
    samples: list[dict] | None = [] if samples_path else None
    with RuleReward(verifiers, [1.0] * len(verifiers)) as reward:
        result = evaluate(engine, tokenizer, prompts, labels, reward, sampling=sampling, n=args.n,
                          threshold=float(len(verifiers)), samples=samples)
    result.update(model=str(path), data=args.data, verifiers=verifiers, n=args.n, temperature=args.temperature)
    print(f"{'strict':>12}: {result['accuracy']:.4f}  (accuracy: the verifiers {', '.join(verifiers)} accept the "
          f"first sample)")
    print(f"{'lenient':>12}: {result['lenient_accuracy']:.4f}  (the first sample's last number is the answer)")
    for key in (f"avg@{args.n}", f"pass@{args.n}", "score/mean", "num_prompts"):
        print(f"{key:>12}: {result[key]:.4f}" if key != "num_prompts" else f"{key:>12}: {int(result[key])}")

    if args.output:
        write_text_atomic(args.output, json.dumps(result, indent=2))
    if samples_path:
        write_text_atomic(samples_path, "".join(json.dumps(row) + "\n" for row in samples))
    return 0


def check_args(args) -> None:
    """The flags' values, checked before any work; each message names its flag."""
    if args.n < 1:
        raise ConfigError("--n must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: must be a number >= 0 (0 means greedy)")
    if args.n > 1 and args.temperature == 0:
        raise ConfigError("--n > 1 needs sampling: give --temperature > 0")
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens}: must be an integer >= 1")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: must be >= 1 (leave it out to evaluate every prompt)")
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype {args.dtype}: unknown; use one of {', '.join(sorted(DTYPES))}")
    for name in args.verifier or ():
        if name not in VERIFIERS:
            raise ConfigError(f"--verifier {name}: unknown verifier; known: {', '.join(VERIFIERS.names())}")


def check_max_tokens(model_dir: Path, max_tokens: int) -> None:
    """``--max-tokens`` above the model's context length would only end in a huge allocation."""
    try:
        limit = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(limit, int) and limit > 0 and max_tokens > limit:
        raise ConfigError(f"--max-tokens {max_tokens}: above the model's context length (max_position_embeddings "
                          f"{limit} in {Path(model_dir) / 'config.json'}); give at most {limit}")
