"""DPO's reference weights: ``ref_model`` read at the iteration ``refer_model_iter``.

MindSpeed-LLM's ``--refer-model-iter`` (default 1) is "the iteration step count of the reference
model's initial weights": when ``ref_model`` names a checkpoint directory with iterations, the
reference loads that iteration, so that a resumed DPO run keeps its initial reference while the
policy continues from its latest save. Here:

* ``ref_model`` a directory with ``iter_XXXXXXX/`` subdirectories (a posttrain save directory or a
  Megatron checkpoint): the reference is ``iter_<refer_model_iter>``; a missing one is refused,
  naming the iterations there;
* ``ref_model`` a model directory (Hugging Face, one ``iter_*`` or a Megatron ``release``): read as
  it is (there is no iteration to pick);
* no ``ref_model``: the reference is a frozen copy of the run's initial weights, which a resume keeps
  (the run's ``initial_model``); ``refer_model_iter`` other than 1 is refused there, as it would
  pick nothing.
"""

from __future__ import annotations

from pathlib import Path

from posttrain.config.megatron import MegatronConfig
from posttrain.errors import ConfigError


def dpo_reference(role: MegatronConfig) -> str | None:
    """The directory DPO's reference loads (None: a copy of the run's initial weights)."""
    iteration = role.refer_model_iter
    if not role.ref_model:
        if iteration != 1:
            raise ConfigError(f"refer_model_iter={iteration}: it picks an iteration of ref_model's checkpoint "
                              f"directory, and ref_model is not set (the reference is then the run's initial "
                              f"weights, kept across resumes); set ref_model to a checkpoint directory, or remove "
                              f"refer_model_iter")
        return None
    root = Path(role.ref_model)
    found = sorted(p.name for p in root.glob("iter_*") if p.is_dir()) if root.is_dir() else []
    if not found:
        return role.ref_model
    name = f"iter_{iteration:07d}"
    if name not in found:
        shown = ", ".join(found[:8]) + (", ..." if len(found) > 8 else "")
        raise ConfigError(f"refer_model_iter={iteration}: ref_model={role.ref_model} holds no {name} (it holds "
                          f"{shown}); set refer_model_iter to one of those iterations")
    return str(root / name)
