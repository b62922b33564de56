"""The separate rollout worker (``rl_config.separate_rollout_worker: true``; formerly spelled
``use_integrated_worker: false``, :mod:`posttrain.config.separated`): rollout in its own process.

A :class:`RolloutWorker` is a Ray actor that holds a replica of the actor's weights and the rollout
engine on them; the trainer stays in the driver process. After each update the trainer's weights
travel to the worker (:meth:`RemoteReplica.load`, timed as ``timing/resharding_to_infer``), and the
rollout thread of :class:`~posttrain.loops.pipeline.RolloutPipeline` calls
:meth:`RemoteEngine.generate`, which waits on Ray while the trainer computes: sampling and training
run in two processes, on their own cores. Synchronous unless ``rl_config.async_staleness >= 1``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from posttrain.cluster import launch
from posttrain.cluster.remote import gather
from posttrain.models.packed_linear import install_run_kernels
from posttrain.roles.policy import build_actor_model, build_rollout, rollout_stop_ids
from posttrain.rollout.base import RolloutEngine, SamplingParams


class RolloutWorker:
    """The rollout replica's process (created with ``ray.remote``)."""

    def __init__(self, cpus: int):
        torch.set_num_threads(max(1, int(cpus)))
        self.model = self.engine = None

    def setup(self, plan, start: dict, state: dict[str, torch.Tensor], cwd: str) -> None:
        """The actor's model and rollout engine, with the trainer's weights ``state``."""
        os.chdir(cwd)  # relative paths of the config (templates, tools) resolve as on the driver
        install_run_kernels(start)  # for the worker's life: the run's fp32 kernel and packing choice
        model, tokenizer, _ = build_actor_model(plan.policy, plan.device, start["source"],
                                                frozen_dtype=plan.frozen_dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.load(state)
        self.engine = build_rollout(plan.rollout, plan.policy, model, tokenizer,
                                    rollout_stop_ids(tokenizer, plan.policy))

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """The weights ``state`` into the worker's model, and into an engine that holds its own copy
        (vLLM: ``sync_weights``, proven by the probe against this model)."""
        with torch.no_grad():
            self.model.load_state_dict(state)
        if getattr(self.engine, "holds_weights", False):
            self.engine.sync_weights(self.model)

    def generate(self, *args, **kwargs) -> list:
        return self.engine.generate(*args, **kwargs)

    def pop_metrics(self) -> dict[str, float]:
        return self.engine.pop_metrics()


class RemoteEngine(RolloutEngine):
    """The worker's engine, called from the driver: the rollout engine's ``generate`` (its weights
    arrive through :meth:`RemoteReplica.load`, so ``sync_weights`` is the protocol's no-op)."""

    def __init__(self, replica: "RemoteReplica"):
        self.replica = replica

    def generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams,
                 stop_token_ids: list[int] | None = None, prompt_keys: list[int] | None = None,
                 **engine_options) -> list:
        """``engine_options``: the worker engine's own (partial rollout's offsets and budgets)."""
        return self.replica.call("rollout", "generate", prompt_token_ids, n, sampling, stop_token_ids,
                                 prompt_keys=prompt_keys, **engine_options)

    def pop_metrics(self) -> dict[str, float]:
        return self.replica.call("rollout metrics", "pop_metrics")


class RemoteReplica:
    """One rollout worker process with ``rl_config.ray_num_cpus_per_worker`` CPUs (or a GPU)."""

    def __init__(self, plan, start: dict, model):
        import ray

        self.timeout_s = plan.cluster.timeout_s
        self.owns_ray = launch.connect(plan.cluster, 1)
        self.handle = None
        try:
            cpus = plan.cluster.cpus_per_worker
            gpu = plan.device.startswith("cuda")
            options = {"num_cpus": 1 if gpu else cpus, "num_gpus": 1 if gpu else 0, "max_restarts": 0}
            self.handle = ray.remote(RolloutWorker).options(**options).remote(cpus)
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            self.call("rollout worker set-up", "setup", plan, start, state, os.getcwd())
        except BaseException:
            self.close()
            raise
        self.engine = RemoteEngine(self)

    shares_trainer_engine = False

    @staticmethod
    def snapshot(model) -> dict[str, torch.Tensor]:
        """A copy of ``model``'s weights now (what :meth:`load` sends)."""
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def call(self, what: str, method: str, *args, **kwargs) -> Any:
        return gather([getattr(self.handle, method).remote(*args, **kwargs)], ["the rollout worker"], what,
                      self.timeout_s)[0]

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.call("weight sync", "load", {k: v.cpu() for k, v in state.items()})

    def close(self) -> None:
        import ray

        handle, self.handle = self.handle, None
        if handle is not None:
            ray.kill(handle)
        if self.owns_ray:
            self.owns_ray = False
            ray.shutdown()
