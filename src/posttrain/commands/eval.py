"""``posttrain eval``: generate on held-out prompts and score them with verifiers.

The data is a preprocessed prompt dataset prefix (with ``labels``), or a JSONL file of
``{"problem": ..., "answer": ...}`` rows (also ``prompt``/``question`` and ``label``/``solution``)
rendered with ``--prompt-type`` (default: the tokenizer's own chat template).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from posttrain.errors import ConfigError, DataError

PROMPT_FIELDS = ("prompt", "problem", "question", "instruction")
LABEL_FIELDS = ("answer", "label", "solution", "output")


def load_jsonl_prompts(path: Path, tokenizer, prompt_type: str | None) -> tuple[list[list[int]], list[str]]:
    from posttrain.data.encoding import TemplateEncoder
    from posttrain.data.templates import get_template

    encoder = TemplateEncoder(get_template(prompt_type or "hf_chat_template"), tokenizer)
    prompts, labels = [], []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: malformed JSON ({err.msg})") from None
        prompt = next((row[k] for k in PROMPT_FIELDS if k in row), None)
        label = next((row[k] for k in LABEL_FIELDS if k in row), None)
        if prompt is None or label is None:
            raise DataError(f"{path}:{lineno}: needs a prompt field ({'/'.join(PROMPT_FIELDS)}) and a label field "
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
        from posttrain.data.datasets import PromptDataset
        from posttrain.reward.decoding import decode_labels

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
    import torch

    from posttrain.device import resolve_device
    from posttrain.models.loading import check_vocab, load_causal_lm, load_tokenizer, resolve_model_path
    from posttrain.reward.rule_reward import RuleReward
    from posttrain.rollout.base import SamplingParams, get_engine
    from posttrain.trainers.evaluate import evaluate

    logging.basicConfig(level=logging.WARNING)
    if args.n < 1:
        raise ConfigError("--n must be >= 1")
    if args.n > 1 and args.temperature == 0:
        raise ConfigError("--n > 1 needs sampling: give --temperature > 0")
    device = resolve_device("auto")
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, device=device)
    check_vocab(model, tokenizer, str(path))
    prompts, labels = load_prompts(args.data, tokenizer, args.prompt_type, args.limit)
    engine = get_engine("native", model=model, pad_token_id=tokenizer.pad_token_id,
                        eos_token_ids=[tokenizer.eos_token_id], dtype=args.dtype)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_k=-1, seed=args.seed)
    verifiers = args.verifier or ["math_equiv"]
    torch.manual_seed(args.seed)
    with RuleReward(verifiers, [1.0] * len(verifiers)) as reward:
        result = evaluate(engine, tokenizer, prompts, labels, reward, sampling=sampling, n=args.n,
                          threshold=float(len(verifiers)))
    result.update(model=str(path), data=args.data, verifiers=verifiers, n=args.n, temperature=args.temperature)
    for key in ("accuracy", f"avg@{args.n}", f"pass@{args.n}", "score/mean", "num_prompts"):
        print(f"{key:>12}: {result[key]:.4f}" if key != "num_prompts" else f"{key:>12}: {int(result[key])}")
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(out)
    return 0
