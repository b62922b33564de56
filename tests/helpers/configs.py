"""The one builder of run configs for the loop tests (integration, e2e, cluster, the mini world).

:func:`run_dict` writes the tiny run every loop test starts from, on the CPU: GRPO on the graded
lowercase reward (:mod:`tests.helpers.verifiers`), 4 prompts x 8 samples, 2 optimizer steps per
iteration, 12 new tokens at temperature 1 (an offline stage, ``sft`` or ``dpo``, gets no rollout keys).
A test changes what it needs section by section, in the YAML's own keys::

    run_dict(model, data, out, iters=2, rl_config={"n_samples_per_prompt": 4, "verifier_modules": OMIT})

Each section's keys replace the builder's (a nested dict such as ``sampling_config`` is replaced
whole); :data:`OMIT` removes a key, so that the run takes its default.
"""

from __future__ import annotations

from pathlib import Path

OMIT = object()
OFFLINE_STAGES = ("sft", "dpo")
VERIFIERS = "tests.helpers.verifiers"  # e2e_lowercase, e2e_has_lowercase, e2e_constant


def updated(cfg: dict, sections: dict) -> dict:
    """``cfg`` with each section of ``sections`` updated key by key (:data:`OMIT` deletes a key; a
    section that ``cfg`` lacks is added)."""
    for section, values in sections.items():
        target = cfg.setdefault(section, {})
        for key, value in values.items():
            if value is OMIT:
                target.pop(key, None)
            else:
                target[key] = value
    return cfg


def run_dict(model: str | Path, data: str | Path, output_dir: str | Path, *, stage: str = "ray_grpo",
             iters: int = 1, **sections) -> dict:
    """The config dict of the tiny run (see the module's docstring); ``sections`` update it."""
    cfg = {
        "megatron_training": {"stage": stage, "global_batch_size": 4, "micro_batch_size": 8, "seq_length": 64,
                              "train_iters": iters, "lr": 3e-3, "lr_decay_style": "constant", "weight_decay": 0.0,
                              "data_path": str(data), "tokenizer_name_or_path": str(model), "seed": 1, "bf16": False,
                              "dataset_additional_keys": ["labels"], "prompt_type": "trl"},
        "rl_config": {"output_dir": str(output_dir), "device": "cpu"},
    }
    if stage not in OFFLINE_STAGES:
        cfg["rl_config"].update({"n_samples_per_prompt": 8, "mini_batch_size": 2,
                                 "verifier_function": ["e2e_lowercase"], "verifier_weight": [1.0],
                                 "verifier_modules": [VERIFIERS], "verifier_parallel": 1, "init_kl_coef": 0.0,
                                 "max_prompt_length": 64})
        cfg["generate_config"] = {"max_model_len": 64, "max_num_seqs": 256, "infer_tensor_parallel_size": 1,
                                  "sampling_config": {"max_tokens": 12, "temperature": 1.0, "top_k": -1, "top_p": 1.0}}
    return updated(cfg, sections)


def run_config(model: str | Path, data: str | Path, output_dir: str | Path, *, name: str = "config",
               stage: str = "ray_grpo", iters: int = 1, **sections):
    """:func:`run_dict` as a validated ``RunConfig`` (named ``name``)."""
    from posttrain.config.run import run_config_from_dict

    return run_config_from_dict(run_dict(model, data, output_dir, stage=stage, iters=iters, **sections), name=name)
