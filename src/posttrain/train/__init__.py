"""Training engine: optimizer, LR schedule, micro/mini-batched updates, response log-probs.

Modules: ``optim`` (AdamW, Megatron-style LR schedule), ``forward`` (batch layout, response
log-probs/values), ``engine`` (TrainEngine, NaNLossError), ``loss_fns`` (actor/critic/SFT/DPO
loss functions for ``TrainEngine.update``). Imports torch; ``import posttrain`` does not.
"""

from posttrain.train.engine import NaNLossError, TrainEngine
from posttrain.train.forward import default_position_ids, pack_batch, response_logprobs, response_values
from posttrain.train.loss_fns import (
    make_actor_loss_fn,
    make_critic_loss_fn,
    make_dpo_loss_fn,
    make_sft_loss_fn,
    sequence_logps,
)
from posttrain.train.optim import LRScheduler, build_lr_scheduler, build_optimizer

__all__ = [
    "LRScheduler",
    "NaNLossError",
    "TrainEngine",
    "build_lr_scheduler",
    "build_optimizer",
    "default_position_ids",
    "make_actor_loss_fn",
    "make_critic_loss_fn",
    "make_dpo_loss_fn",
    "make_sft_loss_fn",
    "pack_batch",
    "response_logprobs",
    "response_values",
    "sequence_logps",
]
