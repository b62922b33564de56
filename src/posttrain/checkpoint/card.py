"""What a saved model directory says about itself: a model card (``README.md``, with the YAML front
matter the Hugging Face Hub reads), as TRL writes one.

The card names the base model, the algorithm, the data, a digest of the run's resolved config
(the ``config.json`` of its output folder, so two checkpoints can be told apart or matched), the
last logged metrics and the command that made it. It is written atomically next to the weights.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.version import __version__
from posttrain.metrics.sinks import write_text_atomic

CARD = "README.md"
# the metrics a card shows first, when the run logged them
HEADLINE = ("grpo/score/mean", "dapo/score/mean", "critic/score/mean", "actor/pg_loss", "actor/kl_loss",
            "dpo/rewards/accuracies", "sft/loss", "response_length/mean")


@dataclass(frozen=True)
class CardInfo:
    """Everything a card says, gathered by the loop that saves."""

    algorithm: str  # the stage: grpo, dapo, ppo, dpo, sft
    base_model: str  # the model the run started from (a folder or a checkpoint)
    data: str  # megatron_training.data_path
    config_json: str  # the run's resolved config, as written to its output folder
    iteration: int
    metrics: dict[str, float] = field(default_factory=dict)
    command: str = ""  # default: this process's command line
    adapter: bool = False  # a LoRA adapter (PEFT format) rather than a whole model
    role: str = "policy"  # or "critic" (PPO's value model, saved in a directory of its own)

    @property
    def config_digest(self) -> str:
        return hashlib.sha256(self.config_json.encode()).hexdigest()[:16]


def render_card(info: CardInfo) -> str:
    command = info.command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    tags = ["posttrain", info.algorithm, "reinforcement-learning" if info.algorithm in ("grpo", "dapo", "ppo")
            else info.algorithm]
    front = ["---", f"base_model: {json.dumps(info.base_model)}", "library_name: " + ("peft" if info.adapter
                                                                                      else "transformers"),
             "tags:", *(f"- {t}" for t in dict.fromkeys(tags)), "---", ""]
    shown = [k for k in HEADLINE if k in info.metrics] + sorted(k for k in info.metrics if k not in HEADLINE)
    rows = [f"| `{k}` | {info.metrics[k]:.6g} |" for k in shown if isinstance(info.metrics[k], (int, float))]
    body = [f"# {info.algorithm.upper()} {info.role} checkpoint, iteration {info.iteration}", "",
            f"Trained with posttrain {__version__} ({info.algorithm}) from `{info.base_model}`"
            + (" as a LoRA adapter (PEFT format)." if info.adapter else "."), "",
            "| | |", "|---|---|", f"| base model | `{info.base_model}` |", f"| algorithm | {info.algorithm} |",
            f"| data | `{info.data or '-'}` |", f"| iteration | {info.iteration} |",
            f"| config digest | `{info.config_digest}` (sha256 of the run's resolved config.json) |",
            f"| command | `{command}` |", ""]
    if rows:
        body += [f"## Metrics of iteration {info.iteration}", "", "| metric | value |", "|---|---|", *rows, ""]
    return "\n".join(front + body)


def converted_card(source: str | Path, model_type: str, value_model: bool) -> str:
    """The card of an HF directory that ``posttrain convert`` wrote from a Megatron-Core checkpoint."""
    return "\n".join(["---", f"base_model: {json.dumps(str(source))}", "library_name: transformers", "tags:",
                      "- posttrain", "- megatron-core", "---", "",
                      f"# {model_type} {'value model' if value_model else 'model'}, converted", "",
                      f"Converted by posttrain {__version__} (`posttrain convert --load-model-type mg "
                      f"--save-model-type hf`) from the Megatron-Core checkpoint `{source}`.", ""])


def write_model_card(directory: str | Path, info: CardInfo) -> Path:
    """Write the card into ``directory`` (atomically); returns its path."""
    path = Path(directory) / CARD
    write_text_atomic(path, render_card(info))
    return path
