"""The datasets and the batch sampler of a run, from plain values (the run's plan holds them)."""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.data import datasets
from posttrain.data.datasets import PromptDataset
from posttrain.data.sampler import ResumableSampler
from posttrain.errors import ConfigError, DataError


def build_prompt_dataset(prefix: str | None, max_prompt_length: int, *, additional_keys: Sequence[str] = ("labels",),
                         split: str | None = None, key: str = "megatron_training.data_path",
                         images_per_prompt: int | None = None, videos_per_prompt: int = 0):
    """The on-policy prompts of the preprocessed dataset ``prefix`` (the config's ``key``), without
    the prompts of ``max_prompt_length`` tokens or more; with ``images_per_prompt`` (a multimodal
    run) each prompt's images (and at most ``videos_per_prompt`` videos) too
    (:class:`~posttrain.data.image_prompts.ImagePromptDataset`)."""
    if not prefix:
        raise ConfigError(f"{key} is not set: give the prefix of a preprocessed dataset")
    try:
        dataset = PromptDataset(prefix, max_prompt_length=max_prompt_length, additional_keys=list(additional_keys),
                                split=split)
    except DataError as err:
        if key == "megatron_training.data_path" or not str(err).startswith("data_path "):
            raise
        raise DataError(f"{key} {str(err)[len('data_path '):]}") from None  # name the key that gave the prefix
    if len(dataset) == 0:
        why = (f" all {dataset.num_filtered} prompts are at least max_prompt_length={max_prompt_length} tokens"
               if dataset.num_filtered else "")
        raise DataError(f"the prompt dataset {prefix} is empty:{why or ' no rows'}; raise "
                        f"rl_config.max_prompt_length or check the data")
    if images_per_prompt is not None:
        from posttrain.data.image_prompts import ImagePromptDataset

        return ImagePromptDataset(dataset, prefix, images_per_prompt, videos_per_prompt)
    return dataset


_OFFLINE = {"sft": ("SFT dataset", "SFTDataset"),
            "dpo": ("pairwise dataset (AlpacaStylePairwiseHandler)", "PairwiseDataset"),
            "kto": ("unpaired preference dataset (UnpairedPreferenceHandler)", "UnpairedPreferenceDataset")}


def build_offline_dataset(prefix: str | None, stage: str, *, seq_length: int, split: str | None = None,
                          unpaired: bool = False, images_per_sample: int | None = None, videos_per_sample: int = 0):
    """SFT samples (``AlpacaStyleInstructionHandler`` data), DPO pairs (``AlpacaStylePairwiseHandler``)
    or, with ``unpaired`` (KTO), unpaired preference rows (``UnpairedPreferenceHandler``); with
    ``images_per_sample`` (a multimodal SFT run) each SFT sample's images and its videos (at most
    ``videos_per_sample``) too (:class:`~posttrain.data.image_samples.ImageSFTDataset`)."""
    kind, cls = _OFFLINE["kto" if unpaired else stage]
    if not prefix:
        raise DataError(f"megatron_training.data_path is not set: give the prefix of a preprocessed {kind}")
    dataset = getattr(datasets, cls)(prefix, seq_length=seq_length, split=split)
    if len(dataset) == 0:
        raise DataError(f"the {kind} {prefix} is empty")
    if images_per_sample is not None:
        from posttrain.data.image_samples import ImageSFTDataset

        return ImageSFTDataset(dataset, prefix, images_per_sample, videos_per_sample)
    return dataset


def build_sampler(num_samples: int, global_batch_size: int, seed: int, *, no_shuffle: bool = False,
                  full_shuffle: bool = False, train_iters: int = 0, state: dict | None = None):
    """The seeded, resumable batch sampler, with the seed's shuffle flags (``no_shuffle``,
    ``full_shuffle_instruction_dataset``); ``state`` resumes it."""
    sampler = ResumableSampler.from_seed_flags(
        num_samples, global_batch_size, seed, no_shuffle=no_shuffle, full_shuffle_instruction_dataset=full_shuffle,
        total_samples=train_iters * global_batch_size if full_shuffle else None)
    if state is not None:
        sampler.load_state_dict(state)
    return sampler
