"""The PPO critic role: a value model (the HF backbone plus a scalar head) and its training engine.

The critic starts from ``critic_config.load`` (a reward model / sequence-classification checkpoint,
or a causal-LM directory whose backbone is reused), else from the actor's initial weights; a new
head starts at zero, so the first values are 0. It is saved in the ``critic/`` subdirectory of
every checkpoint (``save_checkpoint(extra={"critic": critic.part})``) and restored from there on
resume. The loop's critic phases (values, GAE, value update) are in :mod:`posttrain.trainers.ppo`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from posttrain.config.plan import EngineOptions, Plan
from posttrain.config.run import RunConfig
from posttrain.roles.policy import build_train_engine, model_source

log = logging.getLogger(__name__)


def critic_source(cfg: RunConfig) -> tuple[str, bool]:
    """(path of the critic's initial weights, whether it is the actor's)."""
    critic = cfg.critic
    if critic is not None and critic.load and critic.load != cfg.actor.load:
        return critic.load, False
    return model_source(cfg.actor), True


def build_value_model(path: str, device: str):
    """A :class:`ValueHeadModel` from a checkpoint (``iter_*`` or HF dir); a new head starts at 0."""
    from posttrain.checkpoint import resolve_checkpoint
    from posttrain.models.value_head import ValueHeadModel

    hf_dir, _ = resolve_checkpoint(path)
    if (Path(hf_dir) / "critic" / "config.json").is_file():  # a posttrain PPO checkpoint
        hf_dir = Path(hf_dir) / "critic"
    model = ValueHeadModel.from_pretrained(hf_dir, dtype="float32", device=device, head_init="zero")
    if getattr(model.config, "use_cache", None) is not None:
        model.config.use_cache = False
    return model


class ValueModule(torch.nn.Module):
    """:class:`ValueHeadModel` with the call signature of an HF model (``use_cache`` etc. accepted)."""

    def __init__(self, value_model):
        super().__init__()
        self.value_model = value_model

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        return self.value_model(input_ids, attention_mask=attention_mask, position_ids=position_ids)


class Critic:
    """Value model + train engine; ``part`` is what checkpoints save and resume."""

    def __init__(self, cfg: RunConfig, plan: Plan, state: dict, device: str):
        from posttrain.checkpoint import Part, load_part

        self.role = cfg.critic or cfg.actor  # megatron_training + critic_config
        path, from_actor = critic_source(cfg)
        self.model = build_value_model(str(state["initial_model"]) if from_actor else path, device)
        # padded micro-batches of micro_batch_size rows: remove padding and token budgets apply to
        # the policy's forwards only
        self.engine = build_train_engine(ValueModule(self.model), self.role, plan, EngineOptions(),
                                         metric_prefix="critic")
        self.part = Part(self.model.model, self.engine.optimizer, self.engine.scheduler)
        if int(state["iteration"]) > 0 and not load_part(state["checkpoint_dir"], "critic", self.part,
                                                         no_load_optim=bool(cfg.actor.no_load_optim)):
            log.warning("resumed checkpoint %s has no critic/: the critic starts afresh", state["checkpoint_dir"])
        log.info("critic: value head on %s (%s)", path, "actor weights" if from_actor else "critic_config.load")
