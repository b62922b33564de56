"""The actor worker of the Megatron-Core backend: one process per tensor x pipeline x data-parallel
rank, holding its shard of the policy (:class:`posttrain.roles.megatron_policy.MegatronPolicy`).

The driver (:mod:`posttrain.cluster.group`) sends every call to all the workers of a
data-parallel replica with the same rows, and keeps the answer of the replica's leader (TP rank 0,
PP rank 0): log-probs, the reference and the update are collectives over the replica's tensor and
pipeline groups (the update also over the data-parallel group), and only the leader samples.
Megatron calls run inside the CPU shims on a CPU (:func:`posttrain.training.megatron.cpu_shims.cpu_megatron`);
the rollout runs outside them.

``reward_config``'s frozen reward model (an HF value-head model,
:func:`posttrain.roles.reward_model.build_reward_scorer`) is built in each replica's leader only:
scoring needs no collective (the whole model in one process, as the leader's native rollout copy
is), the driver keeps only the leader's answer anyway, and a copy on every TP x PP rank would cost
the memory and compute of that many identical forwards for nothing.

``rl_config.async_staleness`` (the native engine): each replica's leader also holds a
:class:`~posttrain.cluster.rollout_copy.RolloutCopy` of its HF rollout model, which the rollout
thread samples from (``generate_copy``) while Megatron's update runs in the actor's other thread.
A snapshot of version ``v`` is a copy of the leader's HF model right after update ``v`` (each
update reloads that model, a collective, inside ``update``), so taking and loading snapshots needs
no collective; the other ranks hold no copy and answer nothing. With ``rollout_engine: vllm`` the
leader's engine is the copy (:class:`~posttrain.cluster.rollout_copy.EngineCopy`): ``update`` does
not push its weights to it, a snapshot is the gathered layers in host memory with the probe scored
on them (a collective over the replica: the other ranks follow), and loading one is the engine's
``sync_weights`` of it (no collective).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from posttrain.errors import CheckpointError
from posttrain.cluster.rollout_copy import EngineCopy, RolloutCopy
from posttrain.cluster.worker import ActorWorker, continued, worker_node_id
from posttrain.roles.megatron_policy import MegatronPolicy
from posttrain.roles.policy import build_rollout, load_policy_tokenizer
from posttrain.roles.reward_model import build_reward_scorer
from posttrain.training.megatron.cpu_shims import cpu_megatron
from posttrain.training.megatron.model import hf_weights
from posttrain.training.offload import WeightOffload


class MegatronWorker(ActorWorker):
    """Rank ``rank`` of ``world_size`` Megatron-backend workers."""

    parked: WeightOffload | None = None  # generate_config.offload_train_param: this rank's weights during rollout
    engine_copy = False  # async_staleness with vLLM: the leader's engine is its rollout copy (setup)

    def megatron(self):
        """Around every pass over the model: the weights back on the device if the rollout parked
        them; Megatron's CPU shims on a CPU, nothing on CUDA."""
        if self.parked is not None:
            self.parked.to_device()
        if self.device.startswith("cuda"):
            return contextlib.nullcontext()

        return cpu_megatron()

    def setup(self, plan, start: dict, master: tuple[str, int], timeout_s: float, cwd: str) -> dict:
        self.join(plan, start, master, timeout_s, cwd)
        tokenizer, stops = load_policy_tokenizer(plan.policy, start["source"])
        with self.megatron():
            self.shard = MegatronPolicy(plan, self.device, tokenizer, stops, source=start["source"])
        self.policy, self.fsdp, self.reward_model = self.shard.policy, False, None
        if plan.stage.on_policy and plan.reward_model is not None and self.shard.leader:  # frozen, the leader's
            self.reward_model = build_reward_scorer(plan.reward_model, tokenizer, self.device)
        if plan.stage.on_policy and plan.rollout.offload_weights and self.device.startswith("cuda"):
            self.parked = WeightOffload(torch.nn.ModuleList(self.shard.chunks))  # a CPU: no effect (warned)
        self.copy = None
        asynchronous = plan.stage.on_policy and plan.off_policy.staleness is not None
        self.engine_copy = asynchronous and self.shard.view is not None  # vLLM: the leader's engine is the copy
        self.rollout_holds_weights = self.engine_copy  # the driver's pipeline loads it (never ``sync_rollout``)
        if self.engine_copy and self.shard.leader:
            self.copy = EngineCopy(self.shard.rollout)
        elif asynchronous and self.shard.leader:
            self.copy = RolloutCopy(self.shard.hf_model, lambda m: build_rollout(plan.rollout, plan.policy, m,
                                                                                 tokenizer, stops),
                                    None if self.device.startswith("cuda") else self.cpu_threads)
        return dict(self.shard.state) if self.rank == 0 else {}

    def ready_info(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "node": worker_node_id(), "threads": torch.get_num_threads(),
                "device": self.device, "replica": self.shard.dp_rank, "leader": self.shard.leader,
                "rollout_holds_weights": self.rollout_holds_weights,
                "rollout_supports_rounds": bool(getattr(self.policy.rollout, "supports_rounds", False)),
                "image_token_id": self.policy.image_token_id}

    # ---- roles ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling, stop_token_ids, prompt_keys=None,
                 sample_offsets=None, position_offsets=None, max_new_tokens=None, images=None) -> list:
        """The leader samples its replica's share (native: from its HF copy, a VLM's with the prompts'
        ``images``; vLLM: its engine; a continued response's offsets and caps as in
        :meth:`ActorWorker.generate`); the other ranks have no rollout. With ``offload_train_param`` every rank's trained weights (their
        storages: Megatron's DDP buffers where it has them) wait in host memory from here until the
        next pass over the model (:meth:`megatron`): the rollout samples from its own copy."""
        if self.parked is not None:
            self.parked.to_host()
        if self.policy.rollout is None or not prompts:
            return []
        return self.policy.rollout.generate(prompts, n, sampling, stop_token_ids, prompt_keys=prompt_keys,
                                            **continued(sample_offsets, position_offsets, max_new_tokens, images))

    def generate_copy(self, prompts: list[list[int]], *args, **kwargs) -> list:
        """:meth:`generate` on the leader's rollout copy (``async_staleness``): no collective, beside
        the update; the other ranks hold no copy and answer []."""
        if self.copy is None:
            return []
        return super().generate_copy(prompts, *args, **kwargs)

    def snapshot_copy(self, version: int) -> None:
        """Keep the weights of the last update as snapshot ``version`` of the rollout copy. Native: the
        leader's HF rollout model (``update`` reloads it), copied; no collective. vLLM: a host
        :class:`~posttrain.rollout.vllm_weights.WeightSnapshot` of the gathered layers with the probe
        scored on them, a collective over the replica (the other ranks follow)."""
        if self.engine_copy:
            with self.megatron():
                if self.copy is not None:
                    self.copy.keep(version, self.shard.view)
                else:
                    self.shard.view.follow()
        elif self.copy is not None:
            self.copy.keep(version, {k: v.detach().clone() for k, v in self.shard.hf_model.state_dict().items()})

    def load_copy(self, version: int) -> int:
        return self.copy.load(version) if self.copy is not None else 0

    def compute_logprobs(self, batch: dict, temperature: float, micro_batch_size, reference: bool = False):
        engine = self.policy.reference if reference else self.policy.actor
        rows, width = batch["response_mask"].shape
        if rows == 0:  # the whole replica got no rows
            return torch.zeros(0, width)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self.megatron():
            return engine.compute_logprobs(batch, temperature=temperature, micro_batch_size=micro_batch_size).cpu()

    def compute_pair_logps(self, batch: dict, average: bool, micro_batch_size):
        """DPO: the reference's sequence log-probs of this replica's pairs (rows two per pair)."""
        if next(iter(batch.values())).shape[0] == 0:
            return torch.zeros(0), torch.zeros(0)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self.megatron():
            return self.policy.reference.compute_pair_logps(batch, average=average, micro_batch_size=micro_batch_size)

    def update(self, batch: dict, loss_fn, mini_batch_size: int,
               micro_batch_size: int | None = None) -> list[dict[str, float]]:
        """The replica's slices of the global mini-batches, one optimizer step each; then the
        weights to the leader's rollout (``timing/resharding_to_infer`` on the last step, and with
        vLLM ``rollout/sync_probe_diff``: the largest over the replicas' engines since the last
        update, their start included, and on a GPU ``timing/resharding_to_train``, their sleep); with
        ``async_staleness`` a vLLM engine gets nothing here (the pipeline loads its snapshots)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self.megatron():
            steps = self.policy.actor.update(batch, loss_fn, mini_batch_size=mini_batch_size,
                                             micro_batch_size=micro_batch_size)
            # async vLLM: the engine loads the snapshot the pipeline asks for (load_copy), not these weights
            seconds = self.shard.sync_rollout() if self.shard.plan.stage.on_policy and not self.engine_copy else None
        if seconds is not None and steps:
            steps[-1]["timing/resharding_to_infer"] = seconds
            if self.shard.view is not None:  # every rank calls update: collectives over all of them
                popped = self.shard.pop_rollout_metrics()
                steps[-1]["rollout/sync_probe_diff"] = self._largest(popped.get("rollout/sync_probe_diff", 0.0))
                to_train = self._largest(popped.get("timing/resharding_to_train", 0.0))  # GPU: vLLM's sleep
                if to_train > 0:
                    steps[-1]["timing/resharding_to_train"] = to_train
        return steps

    def _largest(self, value: float) -> float:
        """The largest of every rank's ``value`` (a collective)."""
        box = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return float(box.item())

    def compute_values(self, batch: dict, micro_batch_size):
        rows, width = batch["response_mask"].shape
        if rows == 0:
            return torch.zeros(0, width)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self.megatron():
            return self.shard.critic.compute_values(batch, micro_batch_size=micro_batch_size).cpu()

    def critic_update(self, batch: dict, loss_fn, mini_batch_size: int,
                      micro_batch_size: int | None = None) -> list[dict[str, float]]:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with self.megatron():
            return self.shard.critic.update(batch, loss_fn, mini_batch_size=mini_batch_size,
                                            micro_batch_size=micro_batch_size)

    def score_rewards(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        """The reward model's scores of this replica's rows, from its leader (the other ranks hold
        no reward model and answer [], which the driver drops)."""
        if self.reward_model is None or not prompts:
            return []
        return self.reward_model.score_sequences(prompts, responses)

    def critic_save(self, iteration: int, trainer_state: dict):
        """The critic's own checkpoint in ``critic_config.save`` (Megatron's layout; every rank
        writes its shard, a collective), its path; None when the critic is saved inside the
        policy's checkpoints (``critic/``). A failed save is answered as ``{"error": message}``
        (see :meth:`save`)."""
        with self.megatron():
            try:
                path = self.shard.save_critic(iteration, trainer_state)
            except CheckpointError as err:
                return {"error": str(err)}
        return str(path) if path is not None else None

    def save(self, save_dir: str, iteration: int, sampler_state, trainer_state: dict, save_optim: bool,
             save_rng: bool, files: dict | None = None) -> str:
        """Every rank writes its shard (data-parallel rank 0 of each model-parallel rank writes). A
        failed save (a full disk) is answered as ``{"error": message}``, the same on every rank, so
        the driver raises one CheckpointError (not a worker's traceback)."""
        with self.megatron():
            try:
                path = self.shard.save(save_dir, iteration, sampler_state=sampler_state, trainer_state=trainer_state,
                                       save_optim=save_optim, save_rng=save_rng, files=files)
            except CheckpointError as err:
                return {"error": str(err)}
        return str(path)

    def state_dict(self) -> dict:
        """The full weights in the HF layout (a collective over the replica's TP and PP groups)."""
        with self.megatron():
            return {name: tensor.cpu().clone() for name, tensor in hf_weights(self.shard.chunks, self.shard.args)}

    def close(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception), self.megatron():
                from megatron.core import parallel_state as ps

                ps.destroy_model_parallel()
        super().close()
