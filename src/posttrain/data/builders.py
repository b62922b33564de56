"""The datasets and the batch sampler of a run, built from its config."""

from __future__ import annotations

from posttrain.config.megatron import MegatronConfig
from posttrain.errors import ConfigError, DataError


def build_prompt_dataset(actor: MegatronConfig, max_prompt_length: int, data_path: str | None = None):
    """The on-policy prompts (``data_path`` or ``megatron_training.data_path``), without the prompts
    of ``max_prompt_length`` tokens or more."""
    from posttrain.data.datasets import PromptDataset

    prefix = data_path or actor.data_path
    if not prefix:
        raise ConfigError("megatron_training.data_path is not set: give the prefix of a preprocessed dataset")
    dataset = PromptDataset(prefix, max_prompt_length=max_prompt_length,
                            additional_keys=actor.dataset_additional_keys or ["labels"], split=actor.split)
    if len(dataset) == 0:
        why = (f" all {dataset.num_filtered} prompts are at least max_prompt_length={max_prompt_length} tokens"
               if dataset.num_filtered else "")
        raise DataError(f"the prompt dataset {prefix} is empty:{why or ' no rows'}; raise "
                        f"rl_config.max_prompt_length or check the data")
    return dataset


_OFFLINE = {"sft": ("SFT dataset", "SFTDataset"),
            "dpo": ("pairwise dataset (AlpacaStylePairwiseHandler)", "PairwiseDataset")}


def build_offline_dataset(actor: MegatronConfig, stage: str):
    """SFT samples (``AlpacaStyleInstructionHandler`` data) or DPO pairs (``AlpacaStylePairwiseHandler``)."""
    from posttrain.data import datasets

    kind, cls = _OFFLINE[stage]
    if not actor.data_path:
        raise DataError(f"megatron_training.data_path is not set: give the prefix of a preprocessed {kind}")
    dataset = getattr(datasets, cls)(actor.data_path, seq_length=actor.seq_length, split=actor.split)
    if len(dataset) == 0:
        raise DataError(f"the {kind} {actor.data_path} is empty")
    return dataset


def build_sampler(num_samples: int, actor: MegatronConfig, state: dict | None = None):
    """The seeded, resumable batch sampler, with the seed's shuffle flags; ``state`` resumes it."""
    from posttrain.data.sampler import ResumableSampler

    full = actor.full_shuffle_instruction_dataset
    sampler = ResumableSampler.from_seed_flags(
        num_samples, actor.global_batch_size, actor.seed, no_shuffle=actor.no_shuffle,
        full_shuffle_instruction_dataset=full,
        total_samples=actor.train_iters * actor.global_batch_size if full else None)
    if state is not None:
        sampler.load_state_dict(state)
    return sampler
