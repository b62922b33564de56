"""The judge role: the LLM-as-judge that rates the on-policy loop's responses (``Plan.judge``).

Built once in the training process from :class:`~posttrain.config.judge.JudgeOptions`: a frozen
causal LM loaded from ``rl_config.judge_path`` (any path ``posttrain train`` loads a model from) with
its own tokenizer, or, for ``judge_path: policy``, the actor's own model object and tokenizer (the
self-judge rates with the weights of the step it scores). Either way it generates through a
:class:`~posttrain.rollout.native.NativeEngine` of its own, greedy or seeded
(:mod:`posttrain.reward.judge`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from posttrain.config.judge import JudgeOptions
from posttrain.errors import ConfigError
from posttrain.models.loading import load_causal_lm, load_tokenizer, resolve_model_dir
from posttrain.reward.judge import JudgeGenerator, JudgeScorer
from posttrain.reward.judge_parse import compile_parser
from posttrain.rollout.native import NativeEngine

log = logging.getLogger(__name__)

JUDGE_MAX_SEQS = 1024  # judgements per engine call (a read's replies are one call where they fit)


def eos_ids(model, tokenizer) -> list[int]:
    """The judge's stop tokens: its tokenizer's eos and its generation config's."""
    ids = [tokenizer.eos_token_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += configured if isinstance(configured, list) else [configured]
    return sorted({int(i) for i in ids if i is not None})


def judge_model(options: JudgeOptions, device: str):
    """(model, tokenizer) of a judge directory, frozen, on ``device``."""
    if not Path(options.path).exists():
        raise ConfigError(f"rl_config.judge_path: {options.path} does not exist; give a causal-LM directory (an HF "
                          f"model or a posttrain checkpoint) or 'policy' (the self-judge)")
    model_dir = resolve_model_dir(options.path)
    model = load_causal_lm(model_dir, device=device, dtype=options.dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, load_tokenizer(model_dir)


def build_judge(options: JudgeOptions, policy, device: str) -> JudgeScorer:
    """The judge of ``options`` (``policy``: the in-process :class:`~posttrain.roles.policy.Policy`,
    whose model and tokenizer the self-judge uses)."""
    if options.self_judge:
        model, tokenizer, stops = policy.model, policy.tokenizer, list(policy.stop_token_ids)
    else:
        model, tokenizer = judge_model(options, device)
        stops = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)
    engine = NativeEngine(model, pad_token_id=pad, eos_token_ids=stops, max_num_seqs=JUDGE_MAX_SEQS,
                          dtype=options.dtype, sampling_copy=False)
    generator = JudgeGenerator(engine, tokenizer, max_tokens=options.max_tokens, timeout_s=options.timeout_s,
                               temperature=options.temperature, seed=options.seed, stop_token_ids=stops)
    log.info("judge: %s on %s (%s, at most %d tokens, weight %g)", "the policy itself" if options.self_judge
             else options.path, device, options.dtype, options.max_tokens, options.weight)
    return JudgeScorer(generator, options.template, compile_parser(options.parser), max_score=options.max_score,
                       failure_value=options.failure_value)
