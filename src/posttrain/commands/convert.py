"""``posttrain convert``: Hugging Face <-> Megatron-Core checkpoints, with the seed's argument names.

``--load-model-type hf --save-model-type mg`` splits an HF directory for TP x PP (written to
``<save-dir>/release/`` with the tracker). ``--load-model-type mg --save-model-type hf`` merges a
Megatron checkpoint back into ``<save-dir>/mg2hf/``, the seed's convention, reusing ``<save-dir>``'s
config.json and tokenizer when it is the original HF directory. ``--merge-lora`` (hf -> hf) merges
a LoRA run's adapter into its base model and writes ``<save-dir>`` as a plain HF model.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator

from posttrain.errors import ConfigError

# The seed's flags that change nothing here: accepted so its tutorial commands run as written.
NO_OPS = ("use_mcore_models", "model_type", "model_type_hf", "max_queue_size", "no_checking",
          "load_checkpoint_loosely")
# The seed's flags posttrain does not implement: refused by name.
REFUSED = {
    "moe_grouped_gemm": "mixture-of-experts conversion is not implemented (dense models only)",
    "moe_tp_extend_ep": "mixture-of-experts conversion is not implemented (dense models only)",
    "noop_layers": "no-op layers are not supported",
    "qlora_nf4": "QLoRA NF4 quantisation is not supported",
    "save_lora_to_hf": "LoRA weights are not converted to Megatron (merge them: --merge-lora)",
    "lora_load": "LoRA weights are not converted to Megatron (merge them: --merge-lora)",
    "lora_r": "LoRA weights are not converted to Megatron (merge them: --merge-lora)",
    "lora_alpha": "LoRA weights are not converted to Megatron (merge them: --merge-lora)",
    "lora_target_modules": "LoRA weights are not converted to Megatron (merge them: --merge-lora)",
    "spec": "custom layer specs are not supported; the local Megatron-Core GPT layer is used",
    "ckpt_cfg_path": "checkpoint config files are not read; the architecture comes from config.json or the checkpoint's args",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load-model-type", required=True, choices=("hf", "mg", "optim"),
                   help="hf: a Hugging Face directory; mg: a Megatron(-Core) checkpoint")
    p.add_argument("--save-model-type", required=True, choices=("hf", "mg"))
    p.add_argument("--load-dir", required=True, help="the checkpoint to read")
    p.add_argument("--save-dir", required=True,
                   help="mg: the checkpoint root written (release/ + tracker); hf: the original HF directory of the "
                        "model, or any directory; the result goes to <save-dir>/mg2hf/")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-model-parallel-size", type=int, default=1,
                   help="only 1 (hf -> mg writes dense models; a mixture-of-experts model's torch_dist "
                        "checkpoints convert mg -> hf)")
    p.add_argument("--num-layer-list", default=None, help="uneven pipeline stages, e.g. 14,14")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    p.add_argument("--params-dtype", default=None, help="fp32, bf16 or fp16 (default: the dtype stored)")
    p.add_argument("--add-qkv-bias", action="store_true", help="the model has q/k/v biases (Qwen2/Qwen2.5)")
    p.add_argument("--orm", action="store_true", help="a reward model: backbone + scalar rm_head")
    p.add_argument("--tokenizer-model", default=None, help="tokenizer file or directory copied into the HF output")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--loader", default="megatron", help="only 'megatron' (and the seed's hf loaders)")
    p.add_argument("--saver", default="megatron", help="only 'megatron'")
    p.add_argument("--merge-lora", action="store_true",
                   help="with --load-model-type hf --save-model-type hf: merge a LoRA run's adapter (--load-dir: its "
                        "save directory or checkpoint) into its base model, written to --save-dir")
    p.add_argument("--force", action="store_true",
                   help="replace an existing converted checkpoint in the target (only convert's own files)")
    p.add_argument("--use-mcore-models", action="store_true", help="accepted; always Megatron-Core")
    p.add_argument("--model-type", default="GPT", choices=("GPT", "BERT"), help="accepted: GPT")
    p.add_argument("--model-type-hf", default=None,
                   help="accepted and not used: the architecture comes from config.json or the checkpoint")
    p.add_argument("--max-queue-size", type=int, default=None, help="accepted; conversion streams in one process")
    p.add_argument("--no-checking", action="store_true", help="accepted; no effect")
    p.add_argument("--load-checkpoint-loosely", action="store_true", help="accepted; no effect")
    for name in REFUSED:
        p.add_argument("--" + name.replace("_", "-"), nargs="?", const=True, default=None,
                       help=argparse.SUPPRESS)


# The flags that shape a conversion, their defaults, and the modes that honour them ("hf-mg", "mg-hf",
# "lora"); given in another mode they are refused ("noted": accepted with a note, as the seed's commands pass them).
SHAPING = {
    "target_tensor_parallel_size": (1, ("hf-mg",), ()),
    "target_pipeline_parallel_size": (1, ("hf-mg",), ()),
    "num_layer_list": (None, ("hf-mg",), ()),
    "num_layers_per_virtual_pipeline_stage": (None, ("hf-mg",), ()),
    "make_vocab_size_divisible_by": (128, ("hf-mg",), ()),
    "params_dtype": (None, ("hf-mg", "mg-hf"), ()),
    "orm": (False, ("hf-mg", "mg-hf"), ()),
    "add_qkv_bias": (False, ("hf-mg",), ("mg-hf",)),
    "tokenizer_model": (None, ("mg-hf",), ("hf-mg",)),
}


def _mode(args: argparse.Namespace) -> str:
    return "lora" if args.merge_lora else f"{args.load_model_type}-{args.save_model_type}"


def _check_shaping_flags(args: argparse.Namespace) -> list[str]:
    """Refuse a shaping flag the mode does not use; the ones it accepts without use, for the note."""
    mode, noted = _mode(args), []
    for name, (default, honoured, accepted) in SHAPING.items():
        value = getattr(args, name)
        if value == default or mode in honoured:
            continue
        flag = "--" + name.replace("_", "-")
        if mode in accepted:
            noted.append(flag)
            continue
        what = {"lora": "--merge-lora writes the merged model in its base's layout and dtype",
                "mg-hf": "mg -> hf reads the split and vocabulary padding from the checkpoint's args"}.get(mode, mode)
        raise ConfigError(f"{flag} {value if value is not True else ''}".rstrip() + f": {what}; drop the flag")
    return noted


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM ends convert as Ctrl-C does, so its staging directory is removed on the way out;
    the process's own SIGTERM handling comes back after (an in-process caller's, and what the processes
    it forks later inherit: a forked pool's workers would otherwise outlive its terminate)."""
    import signal  # lazy: as above

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    _check(args)
    with _sigterm_as_interrupt():
        return _convert(args)


def _convert(args: argparse.Namespace) -> int:
    from posttrain.models.mcore.convert import MG2HF, hf_to_mcore, mcore_to_hf  # lazy: --help imports this module

    noted = [f"--{n.replace('_', '-')}" for n in NO_OPS if getattr(args, n) not in (None, False, "GPT")]
    noted += _check_shaping_flags(args)
    if noted:
        print(f"note: {', '.join(noted)} accepted with no effect here (posttrain reads the architecture itself"
              f"{'; a Megatron checkpoint holds no tokenizer' if '--tokenizer-model' in noted else ''})",
              file=sys.stderr)
    if args.merge_lora:
        from posttrain.models.lora import merge_to_hf  # lazy: as above

        merge_to_hf(args.load_dir, args.save_dir, force=args.force)
    elif args.load_model_type == "hf" and args.save_model_type == "mg":
        hf_to_mcore(args.load_dir, args.save_dir, tp=args.target_tensor_parallel_size,
                    pp=args.target_pipeline_parallel_size, num_layer_list=args.num_layer_list,
                    layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage, dtype=args.params_dtype,
                    orm=args.orm, add_qkv_bias=args.add_qkv_bias, divisor=args.make_vocab_size_divisible_by,
                    force=args.force)
    else:
        from pathlib import Path  # lazy: as above

        save_dir = Path(args.save_dir)
        template = save_dir if (save_dir / "config.json").is_file() else None
        if template is None and args.tokenizer_model and (Path(args.tokenizer_model) / "config.json").is_file():
            template = Path(args.tokenizer_model)
        from posttrain.models.mcore import mcore_files  # lazy: as above

        load_dir = Path(args.load_dir)
        if not load_dir.is_dir():
            raise ConfigError(f"--load-dir {load_dir}: {'not a directory' if load_dir.exists() else 'does not exist'}; "
                              f"give a Megatron checkpoint directory (release/ or iter_* with the tracker)")
        it_dir = mcore_files.iteration_dir(load_dir)
        if (it_dir / "adapter_config.json").is_file():  # a megatron-backend LoRA run: the base is frozen
            raise ConfigError(f"--load-dir {load_dir}: {it_dir} holds a LoRA run (its Megatron files are the frozen "
                              f"base, its adapter is adapter_model.safetensors); merge the adapter into its base "
                              f"with: posttrain convert --merge-lora --load-dir {it_dir} --save-dir <dir>")
        if mcore_files.is_dist_checkpoint(it_dir):
            from posttrain.training.megatron.dist_convert import dist_to_hf  # lazy: Megatron-Core

            dist_to_hf(load_dir, save_dir / MG2HF, template=template, tokenizer=args.tokenizer_model,
                       dtype=args.params_dtype, force=args.force)
        else:
            mcore_to_hf(load_dir, save_dir / MG2HF, template=template, tokenizer=args.tokenizer_model,
                        dtype=args.params_dtype, force=args.force, orm=args.orm or None)
    return 0


def _check(args: argparse.Namespace) -> None:
    for name, why in REFUSED.items():
        if getattr(args, name) is not None:
            raise ConfigError(f"--{name.replace('_', '-')}: {why}")
    pair = (args.load_model_type, args.save_model_type)
    if args.merge_lora and pair != ("hf", "hf"):
        raise ConfigError(f"--merge-lora writes an HF model from a LoRA checkpoint: use --load-model-type hf "
                          f"--save-model-type hf (not {pair[0]} -> {pair[1]})")
    if pair not in (("hf", "mg"), ("mg", "hf")) and not args.merge_lora:
        raise ConfigError(f"--load-model-type {pair[0]} --save-model-type {pair[1]}: posttrain converts hf -> mg "
                          f"and mg -> hf (optimizer states are not converted)")
    if args.loader not in ("megatron", "hf_mcore", "mg_mcore") or args.saver not in ("megatron", "mg_mcore"):
        raise ConfigError(f"--loader {args.loader} / --saver {args.saver}: only the built-in converter exists")
    if args.target_expert_model_parallel_size != 1:
        raise ConfigError("--target-expert-model-parallel-size: mixture-of-experts conversion is not implemented; "
                          "use 1 (dense models)")
    if args.save_model_type == "hf" and (args.target_tensor_parallel_size, args.target_pipeline_parallel_size) != (1, 1):
        raise ConfigError("--save-model-type hf merges every shard: --target-tensor-parallel-size and "
                          "--target-pipeline-parallel-size must be 1 (as in the seed)")
    if args.model_type != "GPT":
        raise ConfigError("--model-type BERT is not supported; use GPT")
