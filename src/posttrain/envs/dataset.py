"""An environment's tasks as on-policy prompts: ``ds[i] = {"prompts": ids, "labels": ids}``, as the
preprocessed :class:`~posttrain.data.datasets.PromptDataset` gives them.

Each task's chat messages are rendered with the run's template (``prompt_type``, the tokenizer's
own chat template by default) and encoded; its ``labels`` are the task's index as text, which
:class:`~posttrain.envs.reward.EnvReward` reads back to find the task that scores a response.
Prompts of ``max_prompt_length`` tokens or more are dropped, as for a preprocessed dataset.
"""

from __future__ import annotations

import numpy as np

from posttrain.envs.config import KEY, EnvOptions
from posttrain.errors import ConfigError


class EnvPromptDataset:
    """The prompts of an environment's tasks (see the module docstring)."""

    def __init__(self, env, tokenizer, template, max_prompt_length: int):
        self.env = env
        self.items: list[dict[str, np.ndarray]] = []
        self.num_filtered = 0
        for index in range(len(env.tasks)):
            messages = env.messages(index)
            system = messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else None
            text = template.render_prompt(messages, system=system, tokenizer=tokenizer)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= max_prompt_length:
                self.num_filtered += 1
                continue
            label = tokenizer.encode(str(index), add_special_tokens=False)
            if tokenizer.decode(label, skip_special_tokens=True).strip() != str(index):
                raise ConfigError(f"{KEY}: the tokenizer does not read back the task index {index} it encoded")
            self.items.append({"prompts": np.asarray(ids, dtype=np.int32), "labels": np.asarray(label, dtype=np.int32)})
        if not self.items:
            raise ConfigError(f"{KEY}: all {self.num_filtered} prompts of the environment are at least "
                              f"max_prompt_length={max_prompt_length} tokens; raise rl_config.max_prompt_length")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return self.items[i]


def build_env_dataset(options: EnvOptions, policy, max_prompt_length: int) -> EnvPromptDataset:
    """The environment ``options`` loaded (a verifiers taskset, :func:`~posttrain.envs.verifiers_tasks.load_tasks`,
    or an OpenEnv-style one, :class:`~posttrain.envs.openenv_local.LocalEnvironment`) and its
    prompts encoded with the policy's tokenizer and prompt template (``policy``: its
    :class:`~posttrain.config.options.PolicyOptions`)."""
    from transformers import AutoTokenizer

    from posttrain.data.templates import get_template
    from posttrain.envs.openenv_local import LocalEnvironment
    from posttrain.envs.verifiers_tasks import load_tasks
    from posttrain.paths import shipped_file

    path = policy.tokenizer or policy.load
    if not path:
        raise ConfigError(f"{KEY} encodes the environment's prompts with the policy's tokenizer: set "
                          "megatron_training.tokenizer_name_or_path to a Hugging Face tokenizer directory")
    env = LocalEnvironment(options) if options.multi_turn else load_tasks(options)
    tokenizer = AutoTokenizer.from_pretrained(path)
    kind = policy.prompt_type_path
    template = get_template(policy.prompt_type or "hf_chat_template",
                            kind if kind and shipped_file(kind).is_file() else None)
    return EnvPromptDataset(env, tokenizer, template, max_prompt_length)
