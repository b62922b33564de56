"""``posttrain judge-pairs``: preference pairs for DPO, labelled by a pairwise LLM judge.

For each prompt of a JSONL file (``--prompt-field``, default ``instruction``) the model
``--model`` samples two responses (``--temperature``, ``--seed``; the prompt in the model's chat
template when its tokenizer has one); the judge ``--judge`` (a causal-LM directory, or ``policy``
for the sampling model itself) compares them in both orders
(:class:`posttrain.reward.judge_pairwise.PairwiseJudge`), and the pairs on which both orders agree
are written to ``--output`` as ``{"instruction", "chosen", "rejected"}`` lines: the pairwise format
``posttrain preprocess`` reads with ``handler_name: AlpacaStylePairwiseHandler``. A summary line
says how many pairs were decided.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.commands.outputs import check_output_file
from posttrain.data.readers import iter_jsonl
from posttrain.errors import ConfigError, DataError


def read_prompts(path: Path, field: str) -> list[str]:
    """The prompt of every line; a line without the field (or with an empty one) raises DataError naming it."""
    prompts = []
    for row, where in iter_jsonl(path):
        value = row.get(field)
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{where}: no text in the field {field!r} (keys: {', '.join(row)}); use --prompt-field")
        prompts.append(value)
    if not prompts:
        raise DataError(f"--prompts {path}: no rows; nothing to sample")
    return prompts


def generator_of(model_dir: str, args, *, max_tokens: int, temperature: float, timeout_s: float, loaded=None):
    """A :class:`~posttrain.reward.judge.JudgeGenerator` on the model in ``model_dir`` (or ``loaded``:
    ``(model, tokenizer)`` already in memory)."""
    from posttrain.reward.judge import JudgeGenerator
    from posttrain.roles.judge import JUDGE_MAX_SEQS, eos_ids
    from posttrain.models.loading import load_causal_lm, load_tokenizer, resolve_model_dir
    from posttrain.rollout.native import NativeEngine

    if loaded is None:
        path = resolve_model_dir(model_dir)
        loaded = (load_causal_lm(path, device=args.device).eval(), load_tokenizer(path))
    model, tokenizer = loaded
    stops = eos_ids(model, tokenizer)
    engine = NativeEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=stops, max_num_seqs=JUDGE_MAX_SEQS)
    return JudgeGenerator(engine, tokenizer, max_tokens=max_tokens, timeout_s=timeout_s,
                          temperature=temperature, seed=args.seed, stop_token_ids=stops), loaded


def run(args) -> int:
    import torch

    from posttrain.reward.judge_pairwise import PairwiseJudge, label_pairs, write_preference_jsonl
    from posttrain.reward.judge_parse import compile_choice
    from posttrain.reward.judge_template import PAIRWISE_TEMPLATE, load_template

    for flag, path in (("--model", args.model), ("--judge", args.judge)):
        if not (flag == "--judge" and path == "policy") and not Path(path).is_dir():
            raise ConfigError(f"{flag} {path}: no such directory; give an HF model directory or a posttrain "
                              f"checkpoint" + (" (or 'policy': the --model itself)" if flag == "--judge" else ""))
    output = check_output_file(args.output, force=args.force)
    prompts = read_prompts(Path(args.prompts), args.prompt_field)
    template = (load_template(args.template, "--template", needs=("response_a", "response_b")) if args.template
                else PAIRWISE_TEMPLATE)
    choice = compile_choice(args.choice_parser)
    with torch.inference_mode():
        sampler, policy = generator_of(args.model, args, max_tokens=args.max_tokens, temperature=args.temperature,
                                       timeout_s=float("inf"))
        samples, _ = sampler.generate([p for p in prompts for _ in range(2)])
        judge_gen, _ = generator_of(args.judge, args, max_tokens=args.judge_max_tokens, temperature=0.0,
                                    timeout_s=args.judge_timeout, loaded=policy if args.judge == "policy" else None)
        xs, ys = [s or "" for s in samples[0::2]], [s or "" for s in samples[1::2]]
        result = PairwiseJudge(judge_gen, template, choice).compare(prompts, xs, ys)
    rows = label_pairs(prompts, xs, ys, result.verdicts)
    write_preference_jsonl(output, rows)
    print(f"{len(rows)} of {len(prompts)} pairs decided (both orders agree) -> {output}; replies without a choice: "
          f"{result.metrics['judge/parse_failures']:.0%}")
    return 0
