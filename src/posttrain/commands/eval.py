"""``posttrain eval``: generate on held-out prompts and score them with verifiers.

The data is a preprocessed prompt dataset prefix (with ``labels``), or a JSONL file of
``{"problem": ..., "answer": ...}`` rows (also ``prompt``/``question`` and ``label``/``solution``)
rendered with ``--prompt-type`` (default: the tokenizer's own chat template).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import sys
from collections import Counter
from pathlib import Path

import torch

from posttrain.checkpoint import check_model_files
from posttrain.commands.outputs import check_output_file, refuse_overwriting_inputs
from posttrain.files import write_text_atomic
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


class PromptFilter:
    """The prompts ``eval`` can evaluate, as preprocess and train take them: a row whose prompt is
    empty or not text is skipped, and so is a row whose prompt and ``max_tokens`` do not fit in the
    model's context (``context`` positions; None: no limit known). Each skip prints one line naming
    the row and is counted. A prompt is measured in characters before it is tokenized: one with more
    characters than ``context`` tokens can hold (the tokenizer's longest token, times ``context``)
    cannot fit, and is skipped without tokenizing it whole."""

    def __init__(self, tokenizer, context: int | None, max_tokens: int):
        self.room = None if context is None else context - max_tokens  # prompt tokens that fit
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1) if context is not None else 1
        self.max_chars = None if self.room is None else max(self.room, 0) * max(longest, 1)
        self.context, self.max_tokens = context, max_tokens
        self.skipped: Counter = Counter()

    def skip(self, where: str, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        print(f"skip {where}: {detail}", file=sys.stderr)

    def text_fits(self, text: str, where: str) -> bool:
        if self.max_chars is not None and len(text) > self.max_chars:
            self.skip(where, "prompt too long", f"the prompt has {len(text):,} characters, more than the "
                      f"{self.room:,} tokens left for it in the model's context ({self.context} positions - "
                      f"--max-tokens {self.max_tokens}) can hold")
            return False
        return True

    def tokens_fit(self, ids: list[int], where: str) -> bool:
        if self.room is not None and len(ids) > self.room:
            self.skip(where, "prompt too long", f"the prompt is {len(ids):,} tokens; with --max-tokens "
                      f"{self.max_tokens} that is more than the model's context of {self.context} positions "
                      f"(max_position_embeddings); lower --max-tokens or shorten the prompt")
            return False
        return True


def _field(row: dict, names: tuple[str, ...], where: str, what: str):
    """The value of the first of ``names`` in ``row``; DataError when none is there or it is null."""
    key = next((k for k in names if k in row), None)
    if key is None:
        raise DataError(f"{where}: needs a prompt field ({'/'.join(PROMPT_FIELDS)}) and a label field "
                        f"({'/'.join(LABEL_FIELDS)}); it has {sorted(row)}")
    if row[key] is None:
        raise DataError(f"{where}: the {what} field {key!r} is null; give the {what} as text")
    return key, row[key]


def load_jsonl_prompts(path: Path, tokenizer, prompt_type: str | None,
                       keep: PromptFilter | None = None) -> tuple[list[list[int]], list[str]]:
    encoder = TemplateEncoder(get_template(prompt_type or "hf_chat_template"), tokenizer)
    keep = keep or PromptFilter(tokenizer, None, 0)
    prompts, labels = [], []
    for row, where in iter_jsonl(path):
        _, prompt = _field(row, PROMPT_FIELDS, where, "prompt")
        label_key, label = _field(row, LABEL_FIELDS, where, "label")
        if isinstance(label, (dict, list)):
            raise DataError(f"{where}: the label field {label_key!r} is a {type(label).__name__}; give the "
                            f"expected answer as text or a number")
        if isinstance(prompt, (dict, list)):
            keep.skip(where, "prompt not text", f"prompt is a {type(prompt).__name__}, expected text")
            continue
        prompt = str(prompt)
        if not prompt.strip():
            keep.skip(where, "empty prompt", "empty prompt")
            continue
        if not keep.text_fits(prompt, where):
            continue
        ids = encoder.encode_prompt(prompt)
        if keep.tokens_fit(ids, where):
            prompts.append(ids)
            labels.append(str(label))
    return prompts, labels


def load_prompts(data: str, tokenizer, prompt_type: str | None, limit: int | None,
                 keep: PromptFilter | None = None):
    path = Path(data)
    keep = keep or PromptFilter(tokenizer, None, 0)
    if path.suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise DataError(f"--data {path}: no such file")
        prompts, labels = load_jsonl_prompts(path, tokenizer, prompt_type, keep)
    else:
        try:
            ds = PromptDataset(data, max_prompt_length=None)
        except DataError as err:  # name the flag that gave the prefix, not the config key
            message = str(err)
            raise DataError("--data " + message[len("data_path "):] if message.startswith("data_path ")
                            else message) from None
        rows = [(i, ds[i]) for i in range(len(ds))]
        rows = [(i, it) for i, it in rows if keep.tokens_fit([int(t) for t in it["prompts"]], f"{data} row {i}")]
        prompts = [[int(t) for t in it["prompts"]] for _, it in rows]
        labels = decode_labels(tokenizer, [[int(t) for t in it["labels"]] for _, it in rows])
    if limit:
        prompts, labels = prompts[:limit], labels[:limit]
    if not prompts:
        skipped = f" (skipped: {dict(keep.skipped)})" if keep.skipped else ""
        raise DataError(f"--data {data}: no prompts{skipped}")
    return prompts, labels


def data_files(data: str) -> list[Path]:
    """The files ``--data`` reads: the JSONL file, or an indexed dataset's ``.bin`` and ``.idx`` files."""
    path = Path(data)
    if path.suffix in (".jsonl", ".json"):
        return [path]
    return [Path(p) for p in glob.glob(glob.escape(data) + "_packed_*_document.*")]


def run(args) -> int:
    logging.basicConfig(level=logging.WARNING)
    check_args(args)
    force = bool(getattr(args, "force", False))
    samples_path = getattr(args, "samples", None)
    model_dir = Path(args.model)
    model_files = [p for p in model_dir.rglob("*") if p.is_file()] if model_dir.is_dir() else []
    refuse_overwriting_inputs({"--output": args.output, "--samples": samples_path},
                              {"the --data input": data_files(args.data), "a file of --model": model_files})
    if args.output:  # before the work: an output problem must not cost the whole evaluation
        check_output_file(args.output, "--output", force=force)
    if samples_path:
        check_output_file(samples_path, "--samples", force=force)
    device = resolve_device("auto")
    with use_cpu_linear(resolve_cpu_linear(device)):  # for this command only
        return evaluate_model(args, device, samples_path)


def evaluate_model(args, device: str, samples_path: str | None) -> int:
    """``posttrain eval``'s work once its flags and outputs are checked: print (and write) the scores."""
    samples: list[dict] | None = [] if samples_path else None
    result = score_model(args, device, samples)
    verifiers = result["verifiers"]
    if result["skipped"]:
        print(f"skipped {sum(result['skipped'].values())} row(s), not counted: "
              + ", ".join(f"{n} {reason}" for reason, n in sorted(result["skipped"].items())))
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


def score_model(args, device: str | None = None, samples: list[dict] | None = None) -> dict:
    """The scores of ``args.model`` on ``args.data`` (the ``eval`` flags), as a dict; every response
    appended to ``samples`` when given. ``device``: None picks one (with its CPU kernel) and checks
    the flags first (the Python API's :func:`posttrain.api.evaluate`)."""
    if device is None:
        check_args(args)
        device = resolve_device("auto")
        with use_cpu_linear(resolve_cpu_linear(device)):
            return score_model(args, device, samples)
    path, _ = resolve_model(args.model)
    check_model_files(path)  # a truncated or corrupt file is named, not a loader traceback
    context = check_max_tokens(path, args.max_tokens)
    tokenizer = load_tokenizer(path)
    keep = PromptFilter(tokenizer, context, args.max_tokens)  # before the model: a bad dataset fails first
    prompts, labels = load_prompts(args.data, tokenizer, args.prompt_type, args.limit, keep)
    model = load_merged(path, device=device)  # a LoRA checkpoint: its adapter merged into the base
    check_vocab(model, tokenizer, str(path))
    engine = ROLLOUT_ENGINES.get("native")(model=model, pad_token_id=tokenizer.pad_token_id,
                                           eos_token_ids=[tokenizer.eos_token_id], dtype=args.dtype)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_k=-1, seed=args.seed)
    verifiers = args.verifier or ["math_equiv"]
    torch.manual_seed(args.seed)
    parallel = getattr(args, "verifier_parallel", 1)  # 0: in this process (the Python API's __main__ verifiers)
    with RuleReward(verifiers, [1.0] * len(verifiers), verifier_parallel=parallel) as reward:
        result = evaluate(engine, tokenizer, prompts, labels, reward, sampling=sampling, n=args.n,
                          threshold=float(len(verifiers)), samples=samples)
    result.update(model=str(path), data=args.data, verifiers=verifiers, n=args.n, temperature=args.temperature,
                  skipped=dict(keep.skipped))
    return result


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


def check_max_tokens(model_dir: Path, max_tokens: int) -> int | None:
    """``--max-tokens`` above the model's context length would only end in a huge allocation.
    Returns that length (``max_position_embeddings``; None when the config does not say)."""
    try:
        limit = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    if max_tokens >= limit:
        raise ConfigError(f"--max-tokens {max_tokens}: leaves no room for the prompt in the model's context length "
                          f"(max_position_embeddings {limit} in {Path(model_dir) / 'config.json'}); give less "
                          f"than {limit}")
    return limit
