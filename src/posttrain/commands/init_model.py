"""``posttrain init-model``: a random-init HF model directory and a locally trained tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.commands.outputs import check_writable_dir
from posttrain.config.loader import load_model_yaml
from posttrain.models.arch import arch_from_hf_config
from posttrain.models.init_model import init_model_dir


def init_model(model: str, output: str | Path, **kwargs) -> Path:
    """The model yaml ``model`` (``configs/model/<model>.yaml``, or a path) as a random-init HF model
    directory in ``output`` (:func:`posttrain.models.init_model.init_model_dir` takes ``kwargs``)."""
    name, keys = load_model_yaml(model)
    return init_model_dir(name, keys, output, **kwargs)


def run(args) -> int:
    # before the work: the folder the model goes into takes a file (a full disk fails here, not after)
    check_writable_dir(Path(args.output).absolute().parent, f"--output {args.output}")
    out = init_model(args.model, args.output, corpus=args.corpus, vocab_size=args.vocab_size,
                     tokenizer=args.tokenizer, seed=args.seed, force=bool(getattr(args, "force", False)))
    cfg = json.loads((out / "config.json").read_text())
    arch = arch_from_hf_config(out)
    print(f"wrote {out}: {cfg['architectures'][0]}, {arch.num_params() / 1e6:.2f}M parameters, "
          f"vocab {arch.vocab_size}")
    return 0
