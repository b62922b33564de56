"""Every engine-like class provides the protocol of the role it plays, with compatible signatures
(``posttrain.training.base`` for the training engines, ``posttrain.rollout.base.RolloutEngine`` for the
rollout engines): each protocol method exists with the protocol's parameters (same names, kinds and
order; keyword-only where the protocol has them; the protocol's defaults), and any parameter of
its own has a default. This is the list a third backend must provide. The Megatron and Ray classes
are imported here, lazily: their case skips where the package is missing."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Protocol

import pytest

from posttrain.rollout.base import RolloutEngine
from posttrain.training.base import ActorEngine, CriticEngine, Engine, ReferenceEngine

# "module:Class" -> the protocol it provides
ENGINES = {
    "posttrain.training.engine:TrainEngine": Engine,
    "posttrain.training.megatron.engine:MegatronEngine": Engine,
    "posttrain.models.lora:AdapterOff": ReferenceEngine,
    "posttrain.training.offload:OffloadedReference": ReferenceEngine,
    "posttrain.cluster.group:ActorRole": ActorEngine,
    "posttrain.cluster.group:ReferenceRole": ReferenceEngine,
    "posttrain.cluster.group:CriticRole": CriticEngine,
    "posttrain.cluster.role_groups:GroupCritic": CriticEngine,
    "posttrain.roles.critic:Critic": CriticEngine,
}
ROLLOUT_ENGINES = [
    "posttrain.rollout.native:NativeEngine",
    "posttrain.rollout.multi_turn:MultiTurnEngine",
    "posttrain.rollout.vllm_engine:VLLMEngine",
    "posttrain.models.lora:MergedRollout",
    "posttrain.cluster.group:RolloutRole",
    "posttrain.cluster.rollout_worker:RemoteEngine",
]
# the optional package each module needs, for a clean skip
NEEDS = {"posttrain.training.megatron": "megatron.core", "posttrain.cluster": "ray"}


def load(target: str) -> type:
    module, name = target.split(":")
    for prefix, package in NEEDS.items():
        if module.startswith(prefix):
            pytest.importorskip(package, reason=f"{target} needs {package}")
    return getattr(importlib.import_module(module), name)


def _protocol_members(protocol: type) -> tuple[list[str], list[str]]:
    """The protocol's methods and its data members (annotations), its parent protocols' included."""
    methods, data = [], []
    for base in reversed(protocol.__mro__):
        if base in (Protocol, object) or not getattr(base, "_is_protocol", False):
            continue
        methods += [n for n, v in vars(base).items() if inspect.isfunction(v) and not n.startswith("_")]
        data += list(vars(base).get("__annotations__", {}))
    return list(dict.fromkeys(methods)), list(dict.fromkeys(data))


def signature_problems(want: inspect.Signature, got: inspect.Signature) -> list[str]:
    """How ``got`` (an implementation's method) fails to accept every call ``want`` (the
    protocol's) allows; [] when it is compatible."""
    problems = []
    want_params = [p for p in want.parameters.values() if p.name != "self"]
    got_params = {p.name: p for p in got.parameters.values() if p.name != "self"}
    positional = [p.name for p in got_params.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    for i, p in enumerate(want_params):
        mine = got_params.get(p.name)
        if mine is None:
            problems.append(f"no parameter {p.name!r}")
            continue
        if mine.kind is not p.kind:
            problems.append(f"{p.name!r} is {mine.kind.description}, the protocol's is {p.kind.description}")
        elif p.kind is p.POSITIONAL_OR_KEYWORD and positional[i:i + 1] != [p.name]:
            problems.append(f"{p.name!r} is not positional parameter {i}")
        if p.default is not p.empty and mine.default != p.default:
            problems.append(f"{p.name!r} defaults to {mine.default!r}, the protocol's to {p.default!r}")
    wanted = {p.name for p in want_params}
    for mine in got_params.values():
        if mine.name not in wanted and mine.default is mine.empty and mine.kind is not mine.VAR_KEYWORD:
            problems.append(f"its own parameter {mine.name!r} has no default")
    return problems


def conformance_problems(cls: type, protocol: type) -> list[str]:
    methods, data = _protocol_members(protocol)
    problems = []
    for name in methods:
        mine = getattr(cls, name, None)
        if not callable(mine):
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        want = inspect.signature(getattr(protocol, name))
        problems += [f"{cls.__name__}.{name}: {p}" for p in signature_problems(want, inspect.signature(mine))]
    declared = {n for base in cls.__mro__ for n in vars(base).get("__annotations__", {})}
    problems += [f"{cls.__name__} does not declare {n!r}" for n in data if n not in declared and not hasattr(cls, n)]
    return problems


@pytest.mark.parametrize("target", list(ENGINES))
def test_each_engine_provides_the_protocol_of_its_role(target):
    problems = conformance_problems(load(target), ENGINES[target])
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("target", ROLLOUT_ENGINES)
def test_each_rollout_engine_provides_the_rollout_protocol(target):
    problems = conformance_problems(load(target), RolloutEngine)
    assert not problems, "\n".join(problems)


def test_the_roles_add_up_to_the_backends_protocol():
    methods = {name for protocol in (ReferenceEngine, ActorEngine, CriticEngine)
               for name in _protocol_members(protocol)[0]}
    assert set(_protocol_members(Engine)[0]) == methods == {
        "compute_logprobs", "compute_pair_logps", "compute_values", "update"}
    assert _protocol_members(Engine)[1] == ["optimizer", "scheduler"]
    # one signature per method, whichever role declares it
    assert inspect.signature(ReferenceEngine.compute_logprobs) == inspect.signature(ActorEngine.compute_logprobs)


class _Drifted:
    """Signatures that drift from the protocols as the proxies once did (and worse)."""

    def update(self, batch, loss_fn, *, mini_batch_size, epochs=1, shuffle=False, seed=0):  # no micro_batch_size
        ...

    def compute_values(self, batch, micro_batch_size=None):  # positional, not keyword-only
        ...

    def compute_logprobs(self, batch, *, temperature=0.0, micro_batch_size=None):  # another default
        ...

    def compute_pair_logps(self, batch, *, average=False, micro_batch_size=None, reference):  # required extra
        ...

    def generate(self, *args: Any, **kwargs: Any):  # parameters hidden in *args, **kwargs
        ...


@pytest.mark.parametrize("protocol,expected", [
    (CriticEngine, ["'micro_batch_size'", "compute_values: 'micro_batch_size' is positional or keyword"]),
    (ReferenceEngine, ["'temperature' defaults to 0.0", "own parameter 'reference' has no default"]),
    (RolloutEngine, ["generate: no parameter 'prompt_token_ids'", "sync_weights is missing"]),
    (Engine, ["does not declare 'optimizer'"]),
])
def test_the_check_catches_a_drifted_signature(protocol, expected):
    problems = "\n".join(conformance_problems(_Drifted, protocol))
    for text in expected:
        assert text in problems, problems
