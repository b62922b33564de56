"""A ``verifiers`` (0.4.0, ``verifiers.v1``) taskset as posttrain's prompts and reward.

posttrain maps the taskset's pieces onto its own loop (rather than running the taskset's harness
against an OpenAI-compatible server): each task's ``system_prompt`` and ``prompt`` become a prompt,
rendered with the run's chat template; posttrain's engine samples the response, so tokens and
log-probs stay posttrain's; the response becomes an assistant message of a ``verifiers`` trace, and
the task scores that trace with its own ``Task.score`` (its ``@vf.reward`` functions and the ones
its config plugs in, weighted as ``verifiers`` weights them; ``trace.reward`` is the sum). Scoring
runs on an event loop of its own.

Refused when the taskset is loaded (:func:`load_tasks`), each with the reason: tasks that need a
container, tool servers (toolsets: a multi-turn harness), LLM judges (a client of their own), and
reward functions that need a runtime (``verifiers`` would skip them silently offline).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.envs.config import KEY, EnvOptions
from posttrain.errors import ConfigError


@dataclass
class VerifiersTasks:
    """The tasks of one taskset, in ``load()`` order (``limit`` first ones), and their scoring."""

    tasks: list[Any]
    name: str

    def messages(self, index: int) -> list[dict[str, str]]:
        """Task ``index``'s prompt as chat messages: its system prompt, then its prompt (a string is one
        user message; a message list is kept, role and text)."""
        data = self.tasks[index].data
        out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            out.append({"role": "user", "content": data.prompt})
        else:
            from verifiers.v1.types import content_text

            out += [{"role": m.role, "content": content_text(m.content) or ""} for m in data.prompt or []]
        return out

    def score(self, indexes: Sequence[int], completions: Sequence[str]) -> list[dict[str, tuple[float, float]]]:
        """Each completion scored by its task: ``{reward name: (score, weight)}``, on an event loop of its own."""
        return asyncio.run(_score_all([self.tasks[i] for i in indexes], list(completions)))


async def _score_all(tasks: list[Any], completions: list[str]) -> list[dict[str, tuple[float, float]]]:
    traces = [completion_trace(task, text) for task, text in zip(tasks, completions)]
    await asyncio.gather(*(task.score(trace) for task, trace in zip(tasks, traces)))
    return [{name: (r.score, r.weight) if r is not None else (0.0, 0.0) for name, r in trace.rewards.items()}
            for trace in traces]


def completion_trace(task: Any, completion: str):
    """A ``verifiers`` trace of ``task``'s prompt and one sampled assistant reply ``completion``."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import Trace, TraceTask

    trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                  agent=vf.AgentInfo(config=vf.AgentConfig(), name="posttrain", trainable=True))
    data = task.data
    prompt = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
    if data.system_prompt:
        prompt.insert(0, vf.SystemMessage(content=data.system_prompt))
    for message in [*prompt, vf.AssistantMessage(content=completion)]:
        parent = len(trace.nodes) - 1 if trace.nodes else None
        trace.nodes.append(MessageNode(parent=parent, message=message, sampled=message.role == "assistant"))
    return trace


def load_tasks(options: EnvOptions) -> VerifiersTasks:
    """The taskset ``options.id`` with config ``options.args``, loaded and checked (module docstring)."""
    from pydantic import ValidationError

    try:
        cls = taskset_class(options.id)
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        raise ConfigError(f"{KEY}.id: cannot load the verifiers taskset {options.id!r}: {err}") from None
    config_cls = _config_type(cls)
    try:
        config = config_cls.model_validate({**options.args, "id": options.id})
    except ValidationError as err:
        raise ConfigError(f"{KEY}.args: not a valid {config_cls.__name__} of {cls.__name__}: {err}") from None
    taskset = cls(config)
    if not taskset.bounded and options.limit is None:
        raise ConfigError(f"{KEY}: the taskset {options.id!r} is infinite; set {KEY}.limit to the number of tasks "
                          "to train on")
    tasks = list(taskset.take(options.limit) if options.limit else taskset)
    if not tasks:
        raise ConfigError(f"{KEY}: the taskset {options.id!r} yields no tasks; check {KEY}.args")
    _check_offline(cls, config, tasks[0], options.id)
    return VerifiersTasks(tasks=tasks, name=cls.__name__)


def taskset_class(ident: str) -> type:
    """The ``Taskset`` subclass ``ident`` names: ``module:Class``; a dotted module path whose ``__all__``
    exports one ``Taskset`` subclass (verifiers' own rule, which its loader applies to top-level names
    only); or an id verifiers resolves itself (an installed taskset package, or a built-in one)."""
    import importlib

    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.loaders import taskset_class as verifiers_taskset_class

    module_name, _, attr = ident.partition(":")
    if not attr and "." not in ident:
        return verifiers_taskset_class(ident)
    module = importlib.import_module(module_name)
    if attr:
        found = getattr(module, attr)
        if not (isinstance(found, type) and issubclass(found, Taskset)):
            raise TypeError(f"{ident} is not a verifiers Taskset subclass")
        return found
    names = getattr(module, "__all__", [])
    matches = [obj for name in names if isinstance(obj := getattr(module, name, None), type)
               and issubclass(obj, Taskset) and obj is not Taskset]
    if len(matches) != 1:
        raise TypeError(f"module {module_name!r} must export exactly one Taskset subclass in __all__ (found "
                        f"{[m.__name__ for m in matches]}); or name it as {module_name}:ClassName")
    return matches[0]


def _config_type(cls) -> type:
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig


def _check_offline(cls, config, task, ident: str) -> None:
    """Refuse what posttrain's loop cannot run for this taskset (module docstring)."""
    where = f"{KEY}: the verifiers taskset {ident!r}"
    if type(task).NEEDS_CONTAINER:
        raise ConfigError(f"{where} needs a container per task (Task.NEEDS_CONTAINER); posttrain runs tasks "
                          "in process only: choose a taskset whose tasks score the reply alone")
    if cls.toolsets(config) or type(task).toolsets(task.config):
        raise ConfigError(f"{where} has tool servers (toolsets): a multi-turn harness posttrain does not run; "
                          "for tools use rl_config.multi_turn_enable with a tools file (docs/tools.md)")
    if task.config.judges:
        raise ConfigError(f"{where} scores with LLM judges (task config judges), which call a model client of "
                          "their own; remove the judges from its task config or use a reward model (reward_config)")
    for fn in task.hooks("reward") + task.hooks("metric"):
        param = inspect.signature(fn).parameters.get("runtime")
        if param is not None and param.default is inspect.Parameter.empty:
            raise ConfigError(f"{where}: reward/metric {fn.__name__} needs a runtime (a sandbox of the task), "
                              "which posttrain does not start; verifiers would skip it, so it is refused")
