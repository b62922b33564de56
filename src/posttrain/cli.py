"""The ``posttrain`` command line: parsing only.

Each subcommand names the module whose ``run(args) -> int`` does the work. That module is imported
only when its subcommand runs, so ``posttrain --help`` stays fast and never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from posttrain import __version__
from posttrain.errors import PosttrainError

# subcommand -> module with run(args)
COMMANDS = {
    "plan": "posttrain.commands.plan",
    "train": "posttrain.commands.train",
    "preprocess": "posttrain.commands.preprocess",
    "init-model": "posttrain.commands.init_model",
    "score": "posttrain.commands.score",
    "eval": "posttrain.commands.eval",
    "bench": "posttrain.commands.bench",
    "convert": "posttrain.commands.convert",
    "compare-dumps": "posttrain.commands.compare_dumps",
    "judge-pairs": "posttrain.commands.judge_pairs",
}


def _add_config_args(p: argparse.ArgumentParser, default_path_help: str = "configs/") -> None:
    p.add_argument("--config-name", required=True, help="config file name, with or without .yaml")
    p.add_argument("--config-path", default=None, help=f"folder of configs (default: {default_path_help})")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. rl_config.n_samples_per_prompt=16")


FORCE_HELP = "replace the files this command writes if they exist (nothing else is ever deleted)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Reinforcement-learning post-training of language "
                                     "models: GRPO, DAPO, PPO, DPO and SFT, on a CPU, CUDA or a Ray cluster.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    parser.add_argument("--version", action="version", version=_version())
    # --debug is also accepted after the subcommand; SUPPRESS keeps a subcommand from resetting it
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks for user errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_subparser_class(common))
    sub.required = True

    _add_plan(sub)
    _add_judge_pairs(sub)

    p = sub.add_parser("train", help="run training (GRPO, DAPO, PPO, DPO or SFT, by megatron_training.stage)")
    _add_config_args(p)
    p.add_argument("--load-previous-on-corruption", action="store_true",
                   help="when the checkpoint to resume from is corrupt, resume from the newest earlier complete "
                        "iter_* in the same directory (a warning names both)")

    p = sub.add_parser("preprocess", help="raw JSON/JSONL/Parquet/CSV/Arrow -> Megatron indexed dataset")
    _add_config_args(p, "configs/datasets/")
    p.add_argument("--strict", action="store_true",
                   help="stop at the first row that would be skipped (malformed, empty, too long) or holds invalid UTF-8")
    p.add_argument("--force", action="store_true", help=FORCE_HELP + ": the output_prefix's dataset files")

    p = sub.add_parser("init-model", help="write a random-init HF model directory from a model yaml")
    p.add_argument("--model", default="tiny_qwen2", help="model yaml name in configs/model/, or a path")
    p.add_argument("--output", required=True, help="output directory")
    p.add_argument("--corpus", default=None, help="text file to train the tokenizer on (default: built-in)")
    p.add_argument("--vocab-size", type=int, default=None, help="tokenizer vocabulary size")
    p.add_argument("--tokenizer", default=None, help="use this HF tokenizer directory instead of training one")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--force", action="store_true",
                   help="write into an --output directory that is not empty: replaces only init-model's own files "
                        "(config.json, weights, tokenizer files) and deletes nothing else")

    p = sub.add_parser("score", help="score responses in a JSONL file with named verifiers")
    p.add_argument("--verifier", action="append", required=True, help="verifier name (repeatable)")
    p.add_argument("--input", required=True, help="JSONL with response and label fields")
    p.add_argument("--output", required=True, help="JSONL written with a 'scores' field added")
    p.add_argument("--response-field", default="response")
    p.add_argument("--label-field", default="label")
    p.add_argument("--parallel", type=int, default=1, help="verifier worker processes")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per sample")
    p.add_argument("--verifier-module", action="append", default=[], help="module that registers verifiers")
    p.add_argument("--force", action="store_true", help=FORCE_HELP + ": --output")

    p = sub.add_parser("eval", help="generate on a prompt dataset and score with verifiers")
    p.add_argument("--model", required=True, help="HF model directory (or a checkpoint iter_XXXXXXX)")
    p.add_argument("--data", required=True, help="indexed dataset prefix or JSONL file")
    p.add_argument("--verifier", action="append", default=None, help="verifier name (repeatable)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (avg@k, pass@k)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=None, help="evaluate at most this many prompts")
    p.add_argument("--prompt-type", default=None, help="chat template for JSONL prompts")
    p.add_argument("--output", default=None, help="JSON file for the results")
    p.add_argument("--samples", default=None,
                   help="JSONL file for every response: prompt and sample index, text, label, scores")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--force", action="store_true", help=FORCE_HELP + ": --output, --samples")

    p = sub.add_parser("bench", help="time training iterations: per-phase times, tokens/s, MFU")
    _add_config_args(p)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--output", default=None, help="JSON file for the results")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="run the last iteration under torch.profiler: top ops in DIR/profile.txt, trace in "
                        "DIR/trace.json (chrome://tracing or Perfetto)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP + ": --output, DIR/profile.txt, DIR/trace.json")

    p = sub.add_parser("convert", help="Hugging Face <-> Megatron-Core checkpoints (the seed's convert_ckpt.py "
                                       "arguments), with tensor and pipeline splits")
    importlib.import_module(COMMANDS["convert"]).add_arguments(p)
    _add_compare_dumps(sub)
    return parser


def _add_compare_dumps(sub) -> None:
    p = sub.add_parser("compare-dumps", help="the first tensor whose statistics differ between two accuracy dumps "
                                             "(msprobe_config); exit 1 on a difference, 0 when they agree")
    p.add_argument("dump_a", metavar="A", help="the dump_path of the first run")
    p.add_argument("dump_b", metavar="B", help="the dump_path of the second run")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance: |a - b| <= atol + rtol * |b|")
    p.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance")


def _add_judge_pairs(sub) -> None:
    p = sub.add_parser("judge-pairs", help="sample two responses per prompt and write the pairs a pairwise LLM judge "
                                           "decides in both orders as DPO JSONL")
    p.add_argument("--model", required=True, help="the model that samples (an HF directory or a posttrain checkpoint)")
    p.add_argument("--judge", required=True, help="the judge: a causal-LM directory, or 'policy' (the --model itself)")
    p.add_argument("--prompts", required=True, help="JSONL file of prompts")
    p.add_argument("--prompt-field", default="instruction", help="the prompts' field (default: instruction)")
    p.add_argument("--output", required=True, help="DPO JSONL written: instruction, chosen, rejected")
    p.add_argument("--template", default=None, help="the judge's template, inline or a file, with {prompt} "
                   "{response_a} {response_b} {reference} (default: asks for 'Better: A' or 'Better: B')")
    p.add_argument("--choice-parser", default=None, help="regex with one capture group around A or B "
                   "(default: the last 'Better: X')")
    p.add_argument("--max-tokens", type=int, default=64, help="the most tokens of a sampled response")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the two responses")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--judge-max-tokens", type=int, default=16, help="the most tokens of a judge reply")
    p.add_argument("--judge-timeout", type=float, default=300.0, help="seconds for all the judge's replies "
                   "(replies not finished then decide nothing)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="validate a training config and print its batch plan and memory estimate")
    _add_config_args(p)
    p.add_argument("--hf-config", default=None, help="an HF config.json to size the model (default: the model yaml)")
    p.add_argument("--config-only", action="store_true",
                   help="check the config alone, not the files it names (datasets, the model to start from, the "
                        "save and output directories), e.g. before the data exists; train checks them at start-up")
    p.add_argument("--target", default=None, metavar="KIND:SIZE",
                   help="plan for hardware this machine is not: cuda:80GiB, npu:64GiB (the seed's Ascend NPUs, "
                        "a capacity check: posttrain runs on CUDA) or cpu:24GiB (per node); runs the checks train "
                        "would run there (bf16 on cuda/npu, CUDA-only keys) and compares the memory per device "
                        "with SIZE; the files the config names are not checked")
    p.add_argument("--nodes", type=int, default=None, help="with --target: the nodes of the target cluster")
    p.add_argument("--devices-per-node", type=int, default=None,
                   help="with --target: devices per node; --nodes x --devices-per-node must be the config's "
                        "device count (rl_config.actor_resource.num_npus)")


def _subparser_class(common: argparse.ArgumentParser):
    """An ArgumentParser class whose instances (the subcommands) inherit ``common``'s arguments."""

    class SubParser(argparse.ArgumentParser):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("parents", [common])
            super().__init__(*args, **kwargs)

    return SubParser


def _version() -> str:
    return f"posttrain {__version__}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        module = importlib.import_module(COMMANDS[args.command])
        return int(module.run(args) or 0)
    except PosttrainError as err:
        if getattr(args, "debug", False):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`posttrain plan ... | head`): not an error here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
