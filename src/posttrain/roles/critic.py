"""The PPO critic role: a value model (the HF backbone plus a scalar head) and its training engine.

The critic starts from ``critic_config.load`` (a reward model / sequence-classification checkpoint,
a causal-LM directory whose backbone is reused, a Megatron ``--orm`` checkpoint, or a critic
checkpoint saved by posttrain), else from the actor's initial weights; a new head starts at zero,
so the first values are 0.

Where it is saved, and what it resumes from, follows ``critic_config`` as the actor's checkpoints
follow ``actor_config``:

* ``critic_config.save`` naming a directory of its own (not the actor's): the critic is saved there,
  at the actor's iterations, as a checkpoint of its own (``iter_XXXXXXX/`` with the
  sequence-classification model, optimizer, LR schedule and RNG; ``no_save_optim`` /
  ``no_save_rng`` apply). ``critic_config.load`` naming such a checkpoint resumes it (unless
  ``finetune``; ``no_load_optim`` / ``no_load_rng`` apply).
* otherwise the critic is saved in the ``critic/`` subdirectory of every actor checkpoint and
  resumed from there with the actor (``critic_config.finetune`` / ``no_load_optim`` keep its
  weights only).

The loop's critic phases (values, GAE, value update) are in :mod:`posttrain.loops.ppo`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from posttrain.checkpoint import Part, load_checkpoint, load_part, save_checkpoint
from posttrain.config.plan import Plan
from posttrain.models.loading import resolve_model
from posttrain.models.value_head import ValueHeadModel
from posttrain.roles.policy import build_train_engine, model_source
from posttrain.training.options import EngineOptions

log = logging.getLogger(__name__)


def critic_source(plan: Plan) -> tuple[str, bool]:
    """(path of the critic's initial weights, whether it is the actor's)."""
    if plan.critic is not None and plan.critic.checkpoint.load:
        return plan.critic.checkpoint.load, False
    return model_source(plan.policy), True


def build_value_model(path: str, device: str):
    """A :class:`ValueHeadModel` from a checkpoint (``iter_*`` or HF dir); a new head starts at 0."""
    hf_dir, _ = resolve_model(path)
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
    """Value model + train engine; ``part`` is what checkpoints save and resume.

    The same object serves the in-process session and each Ray actor worker (there its update
    engine's model is wrapped in DDP and ``infer`` computes values on the plain model, as the
    actor's does); on the Ray driver, :class:`posttrain.cluster.group.CriticRole` offers the same
    ``compute_values`` and ``update``. Both provide :class:`posttrain.training.base.CriticEngine`."""

    def __init__(self, plan: Plan, state: dict, device: str):
        self.options = options = plan.critic  # critic_config (else the actor's keys)
        path, from_actor = critic_source(plan)
        self.model = build_value_model(str(state["initial_model"]) if from_actor else path, device)
        # padded micro-batches of micro_batch_size rows: remove padding and token budgets apply to
        # the policy's forwards only
        self.engine = build_train_engine(ValueModule(self.model), options.optim, plan, EngineOptions(),
                                         metric_prefix="critic")
        self.infer = self.engine
        self.part = Part(self.model.model, self.engine.optimizer, self.engine.scheduler)
        self.save_dir = Path(options.save_dir) if options.save_dir else None
        load = options.checkpoint
        if not from_actor and self._resumes_own_checkpoint(path):
            state = load_checkpoint(path, self.model.model, self.engine.optimizer, self.engine.scheduler,
                                    no_load_optim=load.no_load_optim, no_load_rng=load.no_load_rng)
            log.info("critic: resumed from %s (iteration %d)", state["checkpoint_dir"], int(state["iteration"]))
        elif self.save_dir is None and int(state["iteration"]) > 0:
            # inside the actor's checkpoint; finetune / no_load_optim keep the critic's weights only
            if not load_part(state["checkpoint_dir"], "critic", self.part, no_load_optim=not load.restores_optimizer):
                log.warning("resumed checkpoint %s has no critic/: the critic starts afresh", state["checkpoint_dir"])
        log.info("critic: value head on %s (%s)", path, "actor weights" if from_actor else "critic_config.load")

    @property
    def micro_batch_size(self) -> int:
        return self.options.optim.micro_batch_size

    def _resumes_own_checkpoint(self, path: str) -> bool:
        """``critic_config.load`` is a critic checkpoint saved by posttrain (not a model directory)
        and ``finetune`` is off."""
        directory, full = resolve_model(path)
        return full and not self.options.checkpoint.finetune and not (Path(directory) / "critic").is_dir()

    def save(self, iteration: int, *, tokenizer, trainer_state: dict) -> Path | None:
        """Write the critic's own checkpoint (``critic_config.save``); None when it has no directory
        of its own (it is then part of the actor's checkpoint)."""
        if self.save_dir is None:
            return None
        return save_checkpoint(self.save_dir, iteration, self.model.model, self.engine.optimizer,
                               self.engine.scheduler, tokenizer=tokenizer, trainer_state=trainer_state,
                               save_optim=self.options.save_optim, save_rng=self.options.save_rng)

    def compute_values(self, batch, *, micro_batch_size: int | None = None):
        return self.infer.compute_values(batch, micro_batch_size=micro_batch_size or self.micro_batch_size)

    def update(self, batch, loss_fn, *, mini_batch_size: int, epochs: int = 1, shuffle: bool = False, seed: int = 0,
               micro_batch_size: int | None = None):
        return self.engine.update(batch, loss_fn, mini_batch_size=mini_batch_size, epochs=epochs, shuffle=shuffle,
                                  seed=seed, micro_batch_size=micro_batch_size)
