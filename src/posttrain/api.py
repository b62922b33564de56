"""The Python API: what the command line does, from a notebook or a script.

    import posttrain

    @posttrain.register_reward("ends_with_answer")
    def ends_with_answer(response: str, label: str, **kw) -> float:
        return 1.0 if response.strip().endswith(label) else 0.0

    rows = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in (1, 2)]
    summary = posttrain.train("grpo_tiny_qwen2", data=rows, dataset_config="tiny_add",
                              output_dir="runs/notebook", **{"megatron_training.train_iters": 2})
    summary.metrics["grpo/score/mean"]

:func:`train` takes a config the way ``posttrain train`` does (a name in ``./configs`` or the
shipped configs, a YAML path, or the YAML as a dict) with ``section.key`` overrides as keyword
arguments (``rl_config__n_samples_per_prompt=4`` spells ``rl_config.n_samples_per_prompt``).
``data`` (a list of dicts, a JSONL/JSON/Parquet path or a Hugging Face ``datasets.Dataset``) is
preprocessed on the fly with the handler, template and keys of a dataset config
(``configs/datasets/<dataset_config>.yaml``, as ``posttrain preprocess`` reads it) into
``<output_dir>/data``; ``reward`` (a function, or the names of registered verifiers) becomes
``rl_config.verifier_function``. :func:`plan` is ``posttrain plan``; :func:`evaluate` is
``posttrain eval`` returning its results. A reward function registered here lives in this process:
a run on Ray (whose reward workers import their verifiers) needs it in a module listed in
``rl_config.verifier_modules``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.commands.preprocess import load_config as load_dataset_config
from posttrain.config.loader import resolve_config_file
from posttrain.config.options import schedule_options
from posttrain.config.plan import Plan, resolve_plan
from posttrain.config.run import RunConfig, load_run_config, run_config_from_dict
from posttrain.data.preprocess import preprocess
from posttrain.errors import ConfigError
from posttrain.reward.verifiers import VERIFIERS, VerifierFn, register_verifier

ConfigLike = str | Path | Mapping[str, Any] | RunConfig


@dataclass
class RunSummary:
    """What a training run left: its last iteration's metrics, every logged row, and its folders."""

    metrics: dict[str, float]
    history: list[dict[str, Any]] = field(default_factory=list)
    output_dir: Path | None = None  # rl_config.output_dir, default runs/<config name>
    save_dir: Path | None = None


def init_model(model: str = "tiny_qwen2", output: str | Path = "runs/model", *, seed: int = 1234) -> Path:
    """``posttrain init-model``: a random-init HF model (and its tokenizer) from a model yaml."""
    from posttrain.commands.init_model import init_model as write_model

    return write_model(model, output, seed=seed)


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[VerifierFn], VerifierFn]:
    """Decorator: register ``fn(response, label, **kw) -> float`` as the verifier ``name`` (usable in
    ``rl_config.verifier_function`` and as ``train(..., reward=name)``)."""
    return register_verifier(name, overwrite=overwrite)


def overrides_of(options: Mapping[str, Any]) -> list[str]:
    """Keyword arguments as ``section.key=value`` overrides (``__`` spells ``.``; values as YAML)."""
    out = []
    for key, value in options.items():
        dotted = key.replace("__", ".")
        if "." not in dotted:
            raise ConfigError(f"override {key}={value!r}: name its section, e.g. rl_config__{key} or "
                              f"**{{'rl_config.{key}': ...}}")
        out.append(f"{dotted}={json.dumps(value) if not isinstance(value, str) else value}")
    return out


def load_config(config: ConfigLike, overrides: Iterable[str] = ()) -> RunConfig:
    """A :class:`RunConfig` from a name, a YAML path, a dict or a loaded config (with overrides)."""
    overrides = list(overrides)
    if isinstance(config, RunConfig):
        if overrides:
            raise ConfigError("overrides on an already loaded RunConfig: pass the config's name, path or dict")
        return config
    if isinstance(config, Mapping):
        return run_config_from_dict(dict(config), name="config (a dict)", overrides=overrides)
    path = Path(config)
    if path.suffix in (".yaml", ".yml"):
        return load_run_config(path.stem, str(path.parent), overrides)
    return load_run_config(str(config), None, overrides)


def plan(config: ConfigLike, *, files: bool = False, **options: Any) -> Plan:
    """The checked plan of ``config`` (``posttrain plan``); ``files=True`` checks the files it names too."""
    return resolve_plan(load_config(config, overrides_of(options)), files=files)


def prepare_data(data: Any, dataset_config: str, tokenizer: str, folder: Path) -> str:
    """Preprocess ``data`` (rows, a file, or a ``datasets.Dataset``) with ``dataset_config``'s handler
    and template into ``folder``; returns the indexed dataset's prefix (``megatron_training.data_path``)."""
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(data, (str, Path)):
        source = Path(data)
    elif hasattr(data, "to_json") and hasattr(data, "column_names"):  # a Hugging Face datasets.Dataset
        source = folder / "input.jsonl"
        data.to_json(str(source), lines=True)
    elif isinstance(data, Iterable):
        rows = list(data)
        if not rows or not all(isinstance(r, Mapping) for r in rows):
            raise ConfigError("data: give a non-empty list of dicts, a JSONL/Parquet path or a datasets.Dataset")
        source = folder / "input.jsonl"
        source.write_text("".join(json.dumps(dict(r)) + "\n" for r in rows))
    else:
        raise ConfigError(f"data: {type(data).__name__} is not a list of dicts, a path or a datasets.Dataset")
    prefix = folder / "train"
    cfg = load_dataset_config(dataset_config, overrides=[f"input={source}", f"tokenizer_name_or_path={tokenizer}",
                                                         f"output_prefix={prefix}"])
    preprocess(cfg, progress=False)
    return str(prefix)


def train(config: ConfigLike, *, data: Any = None, dataset_config: str | None = None,
          reward: str | Iterable[str] | VerifierFn | None = None, output_dir: str | Path | None = None,
          **options: Any) -> RunSummary:
    """Train ``config`` (see the module docstring); returns the run's :class:`RunSummary`."""
    from posttrain.commands.train import train_config  # the loops: torch and the models

    overrides = overrides_of(options)
    if output_dir is not None:
        overrides.append(f"rl_config.output_dir={output_dir}")
    if reward is not None:
        overrides += reward_overrides(_reward_names(reward), set_keys={o.split("=", 1)[0] for o in overrides})
    cfg = load_config(config, overrides)
    if data is not None:
        if not dataset_config:
            raise ConfigError("train(data=...): name the dataset config whose handler and template preprocess it "
                              "(dataset_config='tiny_add', a file of configs/datasets/)")
        resolve_config_file(dataset_config, None, subdir="datasets")  # a wrong name fails before any work
        folder = Path(schedule_options(cfg).run_dir) / "data"  # the run's output folder (default runs/<name>)
        prefix = prepare_data(data, dataset_config, cfg.actor.tokenizer_name_or_path, folder)
        cfg = load_config(config, [*overrides, f"megatron_training.data_path={prefix}"])
    metrics = train_config(cfg)
    out = Path(schedule_options(cfg).run_dir)
    history_file = out / "metrics.jsonl"
    history = ([json.loads(line) for line in history_file.read_text().splitlines() if line.strip()]
               if history_file.is_file() else [])
    return RunSummary(metrics=dict(metrics), history=history, output_dir=out,
                      save_dir=Path(cfg.actor.save) if cfg.actor.save else None)


def reward_overrides(names: list[str], set_keys: set[str]) -> list[str]:
    """The overrides that score with the verifiers ``names``, weighted equally. The verifier worker
    processes import the modules of the functions registered here (``rl_config.verifier_modules``);
    a function of ``__main__`` (a script, a notebook) exists only in this process, so the verifiers
    then run here (``rl_config.verifier_parallel=0``) unless the caller set that key."""
    out = [f"rl_config.verifier_function={json.dumps(names)}",
           f"rl_config.verifier_weight={json.dumps([1.0] * len(names))}"]
    modules = sorted({VERIFIERS.get(n).fn.__module__ or "__main__" for n in names if n in VERIFIERS})  # None: exec'd
    user = [m for m in modules if not m.startswith("posttrain.")]
    if "__main__" in user and "rl_config.verifier_parallel" not in set_keys:
        out.append("rl_config.verifier_parallel=0")
    if [m for m in user if m != "__main__"] and "rl_config.verifier_modules" not in set_keys:
        out.append(f"rl_config.verifier_modules={json.dumps([m for m in user if m != '__main__'])}")
    return out


def _reward_names(reward: str | Iterable[str] | VerifierFn) -> list[str]:
    if callable(reward):
        name = getattr(reward, "__name__", "reward")
        if name not in VERIFIERS or VERIFIERS.get(name).fn is not reward:
            register_verifier(name)(reward)
        return [name]
    return [reward] if isinstance(reward, str) else list(reward)


def evaluate(model: str | Path, data: str | Path, *, verifiers: Iterable[str] = ("math_equiv",), n: int = 1,
             temperature: float = 0.0, max_tokens: int = 256, prompt_type: str | None = None,
             limit: int | None = None, seed: int = 1234, dtype: str | None = None) -> dict[str, Any]:
    """``posttrain eval`` (the same flags, the same checks): strict and lenient accuracy (and
    ``avg@n``, ``pass@n``) of ``model`` on ``data`` (a JSONL file or an indexed dataset's prefix);
    returns the results."""
    from argparse import Namespace

    from posttrain.commands.eval import score_model

    args = Namespace(model=str(model), data=str(data), verifier=list(verifiers), n=n, temperature=temperature,
                     max_tokens=max_tokens, limit=limit, prompt_type=prompt_type, seed=seed,
                     dtype=dtype or "float32", output=None, samples=None,
                     verifier_parallel=0 if "rl_config.verifier_parallel=0" in reward_overrides(list(verifiers), set())
                     else 1)  # a verifier of __main__ exists only in this process
    return score_model(args)
