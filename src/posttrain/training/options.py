"""The training engine's own option types: how it batches forwards, how a role's optimizer is
built, and the actor loss's hyperparameters. The run's plan (:mod:`posttrain.config.plan`)
derives them once from the config; the engine and the loss functions read them and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.algo.truncation import Truncation


@dataclass(frozen=True)
class TokenBudget:
    """``max_tokens`` per micro-batch (padding-free token count) and at most ``max_rows`` rows."""

    max_tokens: int
    max_rows: int | None = None


@dataclass(frozen=True)
class EngineOptions:
    """How a :class:`~posttrain.training.engine.TrainEngine` batches its forwards.

    ``use_remove_padding`` packs the valid tokens of a micro-batch into one row (with
    ``share_prompt_prefix`` a prompt repeated over rows is packed once); a token budget replaces
    the fixed micro-batch size of log-prob passes (``forward_budget``) and updates
    (``update_budget``); ``loss_mask_key`` names the mask whose tokens a mini-batch's loss counts;
    ``truncation`` (the actor's, with ``rl_config.truncated_sampling_logprobs``) makes the log-prob
    passes report the log-probs of the truncated sampling distribution; ``compile_regions``
    (``rl_config.compile_regions``: true, false or ``"auto"``) runs the update's forwards with
    :mod:`posttrain.training.fused_regions`; ``"auto"`` chooses the regions at the first update
    (:mod:`posttrain.training.compile_auto`) for ``compile_updates`` updates (the run's iterations)."""

    use_remove_padding: bool = False
    share_prompt_prefix: bool = True
    compile_regions: bool | str = False
    compile_updates: int = 1
    forward_budget: TokenBudget | None = None
    update_budget: TokenBudget | None = None
    loss_mask_key: str = "response_mask"
    truncation: Truncation | None = None


@dataclass(frozen=True)
class OptimOptions:
    """One trained role's optimizer, LR schedule and micro-batching (the seed's per-role keys of
    ``megatron_training`` / ``actor_config`` / ``critic_config``): AdamW and the Megatron schedule
    of :mod:`posttrain.training.optim` (or SGD with ``sgd_momentum``: ``optimizer``), ``clip_grad`` on the global gradient norm (0: off),
    ``activation_checkpointing`` from ``recompute_granularity``."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    lr_decay_style: str = "linear"
    optimizer: str = "adam"
    sgd_momentum: float = 0.9
    lr_warmup_fraction: float | None = None
    clip_grad: float = 1.0
    micro_batch_size: int = 1
    activation_checkpointing: bool = False


@dataclass(frozen=True)
class ActorLossOptions:
    """The actor loss's hyperparameters (:func:`posttrain.algo.policy_loss.actor_loss`); the KL
    coefficient is not here: it comes from the KL controller each iteration.

    ``clip_low`` / ``clip_high`` are the resolved bounds of the ratio's clip ``[1 - low, 1 + high]``
    (``rl_config.clip_ratio`` on both sides, or DAPO's clip-higher ``clip_ratio_low`` /
    ``clip_ratio_high``); ``clip_ratio_c`` the dual-clip constant (None: off); ``norm_length`` the constant
    of ``seq-mean-token-sum-norm``; ``temperature`` the sampling temperature the log-probs divide by;
    ``truncation`` the sampling truncation they are taken under (``rl_config.
    truncated_sampling_logprobs``; None: the full distribution); ``kl_penalty`` the KL estimator of
    a KL term in the loss."""

    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    policy_params: tuple[tuple[str, float], ...] = ()  # the policy loss's own keywords (sapo: tau_pos, tau_neg)
    entropy_coeff: float = 0.0
    kl_penalty: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    norm_length: float | None = None
    temperature: float = 1.0
    truncation: Truncation | None = None
