"""Where the on-policy loop meets the accuracy dumps (``msprobe_config``, :mod:`posttrain.metrics.dumps`):
the models each phase runs (named for the module dumps) and the experience columns of ``key_data_dump``.

The loop passes the session's :class:`~posttrain.metrics.dumps.DumpRecorder` around its phases
(:func:`dumped_phase`, through :meth:`posttrain.loops.session.Session.phase`), reads the dock once
before the update (:func:`dump_experience`; the offline loops: their batch, :func:`dump_batch`) and
wraps the on-policy loss functions (:meth:`~posttrain.metrics.dumps.DumpRecorder.watch_loss`); the
math itself records nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from posttrain.metrics.dumps import PHASE_ROLES, DumpRecorder
from posttrain.transfer_dock import TransferDock

# the dock's columns that key_data_dump records, in the order of one iteration
EXPERIENCE = ("prompts", "responses", "scores", "rollout_logprobs", "ref_logprobs", "old_logprobs", "values",
              "advantages", "returns", "rollout_weights")


def engine_models(engine) -> list[torch.nn.Module]:
    """The modules an engine (or the wrappers around one: LoRA's merged rollout, offloading, the
    adapter switched off) runs: each layer's ``model``, and the native engine's sampling copy."""
    found, seen = [], 0
    while engine is not None and seen < 8:
        for name in ("model", "_copy"):  # _copy: the native engine's sampling copy (rollout/native.py)
            module = getattr(engine, name, None)
            if isinstance(module, torch.nn.Module) and all(module is not m for m in found):
                found.append(module)
        engine, seen = getattr(engine, "engine", None), seen + 1
    return found


def phase_models(session, phase: str) -> Callable[[], list[torch.nn.Module]]:
    """The models of one of the loop's phases (:data:`~posttrain.metrics.dumps.PHASE_ROLES`)."""
    if phase == "rollout":
        return lambda: engine_models(session.policy.rollout)
    if phase == "reference_model":
        return lambda: engine_models(session.policy.reference)
    if phase in ("critic_model", "update_critic"):
        return lambda: [session.critic.model] if session.critic is not None else []
    return lambda: [session.policy.model] if session.policy.model is not None else []


@contextlib.contextmanager
def dumped_phase(session, dumps: DumpRecorder, phase: str) -> Iterator[None]:
    """Around one phase: its models' module dumps, and in the update the gradients (key data)."""
    if phase not in PHASE_ROLES:
        with dumps.phase(phase):
            yield
        return
    grads = dumps.watch_grads(session.policy.model) if phase == "update" else contextlib.nullcontext()
    with dumps.watch(phase, phase_models(session, phase)), grads:
        yield


def dump_batch(dumps: DumpRecorder, batch: dict[str, torch.Tensor]) -> None:
    """``key_data_dump`` of the offline loops: each tensor of the iteration's batch (token ids, masks,
    DPO's reference log-probs), by key."""
    if dumps.on("key_data"):
        with dumps.phase("experience"):
            for key in sorted(batch):
                if isinstance(batch[key], torch.Tensor):
                    dumps.record("key_data", key, batch[key])


def dump_experience(dumps: DumpRecorder, td: TransferDock) -> None:
    """``key_data_dump``: each ready experience column over the iteration's rows, in row order."""
    if not dumps.on("key_data"):
        return
    rows = list(range(td.max_len))
    with dumps.phase("experience"):
        for column in EXPERIENCE:
            if column in td.columns and td.ready_rows(column).all():
                batch, _ = td.get("metrics", [column], indexes=rows)
                dumps.record("key_data", column, torch.cat([t.reshape(-1) for t in batch[column]]))
