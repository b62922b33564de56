"""The reward-model role: a frozen value-head model that scores the on-policy loop's responses.

Built once from :class:`~posttrain.config.reward_model.RewardModelOptions` (``Plan.reward_model``)
on the device of the process that scores: the in-process session's, or each Ray actor worker's
(colocated with the actor, :mod:`posttrain.cluster.worker`). It reads the actor's token ids
straight from the TransferDock (prompt ++ response, no text round trip), so it must share the
actor's vocabulary: a tokenizer saved with the reward model must equal the actor's, and the
model's embedding must hold every id the actor's tokenizer can produce.
"""

from __future__ import annotations

import logging
from pathlib import Path

from posttrain.config.reward_model import RewardModelOptions
from posttrain.errors import ConfigError
from posttrain.models.loading import load_tokenizer, resolve_model_dir
from posttrain.models.value_head import ValueHeadModel
from posttrain.reward.reward_model import RewardModelScorer

log = logging.getLogger(__name__)


def reward_model_dir(path: str) -> Path:
    """The HF directory of a reward model named by ``reward_config.load``: the directory itself, the
    newest ``iter_*`` of a posttrain save directory, a Megatron checkpoint's conversion, and in a
    posttrain PPO checkpoint its ``critic/``."""
    if not Path(path).exists():
        raise ConfigError(f"reward_config.load: {path} does not exist")
    hf_dir = resolve_model_dir(path)
    critic = Path(hf_dir) / "critic"
    return critic if (critic / "config.json").is_file() else Path(hf_dir)


def check_same_vocabulary(model_dir: Path, model, tokenizer) -> None:
    """The reward model reads the actor's token ids: refuse a model that would read other tokens."""
    has_tokenizer = any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    if has_tokenizer:
        if load_tokenizer(model_dir).get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"reward_config.load: the tokenizer saved in {model_dir} differs from the actor's; the "
                              f"reward model scores the actor's token ids, so it must use the actor's tokenizer")
    rows = model.model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ConfigError(f"reward_config.load: the actor's tokenizer has {len(tokenizer)} tokens but the reward "
                          f"model in {model_dir} embeds only {rows}; it must share the actor's vocabulary")


def build_reward_scorer(options: RewardModelOptions, tokenizer, device: str) -> RewardModelScorer:
    """The reward model on ``device``, in ``options.dtype``, scoring ``options.micro_batch_size``
    sequences per forward; ``tokenizer`` is the actor's (its pad id pads the batches)."""
    model_dir = reward_model_dir(options.path)
    model = ValueHeadModel.from_pretrained(model_dir, dtype=options.dtype, device=device, require_head=True)
    check_same_vocabulary(model_dir, model, tokenizer)
    for p in model.parameters():
        p.requires_grad_(False)
    log.info("reward model: %s on %s (%s, %d sequences per forward, weight %g)", model_dir, device,
             options.dtype, options.micro_batch_size, options.weight)
    return RewardModelScorer(model, tokenizer, batch_size=options.micro_batch_size)
