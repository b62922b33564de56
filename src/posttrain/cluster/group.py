"""The actor workers as one role: the in-process roles' methods, sharded over Ray actors.

:class:`Cluster` starts (or joins) Ray, places one :class:`~posttrain.cluster.worker.ActorWorker`
per bundle of a placement group, and offers the on-policy loop the same objects an in-process
session has:

* ``rollout.generate(prompts, n, sampling, stop_ids, prompt_keys)``: the prompts are cut into one
  contiguous share per worker, each with its slice of the prompt keys (default: the prompts'
  indices in the whole call) and the same seed (drawn once here when ``sampling.seed`` is None).
  The native engine's sampling is keyed by (seed, prompt key, sample index, token position), so
  the samples are those of one process, whatever the number of workers.
* ``rollout.sync_weights`` / ``rollout.pop_metrics``: where the workers' engines hold their own
  copy of the weights (vLLM), every worker loads its actor's weights into its engine after each update
  (FSDP2: all ranks gather the full parameters once), and each engine's probe metric reaches the
  driver as the maximum over the workers (:data:`WORKER_ROLLOUT_METRICS`). The native engines sample
  from the trained model objects: nothing to load, and their counters stay in the workers.
* ``actor.compute_logprobs`` / ``reference.compute_logprobs``: rows cut into contiguous shares,
  results concatenated in order.
* ``actor.update(batch, loss_fn, mini_batch_size, epochs, shuffle, seed)``: the driver orders the
  rows exactly as :meth:`TrainEngine.update` does (:func:`~posttrain.train.engine.minibatch_order`),
  cuts every mini-batch into ``W`` equal slices and sends worker ``r`` its slices in step order. Each worker
  runs one optimizer step per slice; the engine sums token counts over ranks and DDP averages
  gradients, so every step is the step of the whole global mini-batch.
* ``reference.compute_pair_logps`` (DPO): pairs cut into contiguous shares, as log-probs are.
* ``reward_model.score_sequences`` (``reward_config``): every actor worker loads the reward model;
  rows cut into contiguous shares, scores concatenated in order.
* ``save``: rank 0 writes the full state with :func:`posttrain.checkpoint.save_checkpoint`; the
  checkpoint is the same as an in-process one, so it resumes on any number of workers.

On the Megatron backend (``plan.parallel.backend``) the workers are
:class:`~posttrain.cluster.megatron_worker.MegatronWorker` shards: the rows are cut into one share
per data-parallel *replica* (its TP x PP workers), every worker of a replica gets its replica's
share, and the answer is the replica leader's; ``save`` is a collective that writes Megatron's layout.

With ``use_integrated_worker: false`` and ``reference_resource`` / ``reward_resource``, the reference
and the reward model are not built in the actor workers: they run in worker groups of their own
(:mod:`posttrain.cluster.role_groups`), and ``policy.reference`` / ``reward_model`` are those
groups' proxies.

Every call waits with ``rl_config.ray_timeout_s``; the first failure closes the group (kills the
workers, which may be blocked in a collective with a dead peer, and the role groups) and raises a
ClusterError. A call can also be started without waiting (``start_*``: a
:class:`~posttrain.cluster.remote.Pending`), and several are then awaited together by
:meth:`Cluster.wait_all` (``rl_config.blocking: false``, :mod:`posttrain.loops.overlap`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from posttrain.cluster import launch
from posttrain.cluster.megatron_worker import MegatronWorker
from posttrain.cluster.remote import ClusterError, Pending, wait_all
from posttrain.cluster.reward import RewardGroup
from posttrain.cluster.role_groups import GroupCritic, GroupReference, GroupRewardModel, RoleGroup
from posttrain.cluster.shares import spans, update_shards
from posttrain.cluster.worker import ActorWorker
from posttrain.errors import CheckpointError, ConfigError
from posttrain.roles.policy import Policy, load_policy_tokenizer
from posttrain.rollout.base import RolloutEngine
from posttrain.rollout.keyed import random_seed

log = logging.getLogger(__name__)

# the rollout engines' metrics that reach the driver, and how the workers' values combine into one
WORKER_ROLLOUT_METRICS = {"rollout/sync_probe_diff": max, "timing/resharding_to_train": max}


def replicas(info: list[dict]) -> list[list[int]]:
    """The workers of each data-parallel replica (by the workers' ``replica`` index), the
    replica's leader first."""
    groups: dict[int, list[int]] = {}
    for worker in info:
        groups.setdefault(int(worker["replica"]), []).append(int(worker["rank"]))
    leaders = {int(w["rank"]) for w in info if w["leader"]}
    return [sorted(groups[r], key=lambda rank: (rank not in leaders, rank)) for r in sorted(groups)]


class Cluster:
    """Ray actor workers (one per device / CPU worker) and reward workers (one per node)."""

    def __init__(self, plan, start: dict):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        device = plan.device
        self.fsdp = plan.sharding == "fsdp2"
        self.megatron = plan.parallel.backend == "megatron"
        self.timeout_s = plan.cluster.timeout_s
        self.world = plan.workers
        self.closed = False
        self.owns_ray = launch.connect(plan.cluster, plan.workers + sum(plan.separated.devices.values()))
        self.workers: list = []
        self.pg = None
        self.rewards = None
        self.groups: dict[str, RoleGroup] = {}  # use_integrated_worker: false: roles in worker groups of their own
        try:
            use_gpu = device.startswith("cuda")
            cpus = plan.cluster.cpus_per_worker
            self.pg = launch.placement_group(self.world, use_gpu, cpus, self.timeout_s)
            remote = ray.remote(MegatronWorker if self.megatron else ActorWorker)
            for rank in range(self.world):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
                options = {"num_cpus": 1 if use_gpu else cpus, "num_gpus": 1 if use_gpu else 0, "max_restarts": 0,
                           "scheduling_strategy": strategy}
                self.workers.append(remote.options(**options).remote(rank, self.world, cpus))
            # the names every error uses: which rank, on which node (multi-node: which machine to look at)
            self.nodes = launch.bundle_nodes(self.pg)
            self.names = [f"actor worker rank {r} on {launch.node_label(node)}" for r, node in enumerate(self.nodes)]
            self.node_of = dict(zip(self.names, self.nodes))
            for role, count in plan.separated.devices.items():  # their processes start while the actors set up
                self.groups[role] = RoleGroup(role, count, plan)
            ip, port, _ = self._call("find the rendezvous", [self.workers[0].address.remote()], self.names[:1])[0]
            states = self._all("set-up", "setup", plan, start, (ip, port), self.timeout_s, os.getcwd())
            self.info = self._all("ready check", "ready_info")
            self.replicas = replicas(self.info)
            self.rollout_holds_weights = any(i.get("rollout_holds_weights") for i in self.info)  # vLLM
            if plan.rule_reward is not None:  # SFT and DPO score nothing
                self.rewards = RewardGroup(plan.rule_reward, self.timeout_s)
            self._setup_groups(plan, start, states[0])
        except BaseException:
            self.close()
            raise
        tokenizer, stops = load_policy_tokenizer(plan.policy, start["source"])  # the driver never loads the weights
        reference = None
        if plan.uses_reference:
            reference = GroupReference(self, self.groups["reference"]) if "reference" in self.groups \
                else ReferenceRole(self)
        self.policy = Policy(model=None, tokenizer=tokenizer, actor=ActorRole(self), reference=reference,
                             rollout=RolloutRole(self) if plan.stage.on_policy else None, stop_token_ids=stops,
                             state=states[0])
        self.critic = None
        if plan.uses_critic:
            self.critic = GroupCritic(self, self.groups["critic"]) if "critic" in self.groups else CriticRole(self)
        self.reward_model = None
        if plan.stage.on_policy and plan.reward_model:
            self.reward_model = GroupRewardModel(self, self.groups["reward"]) if "reward" in self.groups \
                else RewardModelRole(self)
        self.rule_reward = self.rewards
        log.info("Ray: %d actor workers (%s): %s", self.world, "; ".join(self.names), self.info)

    def _setup_groups(self, plan, start: dict, state: dict) -> None:
        """The roles with worker groups of their own (``plan.separated``) built (from the trainer
        state ``state`` of the actor workers' set-up) and ready."""
        pendings = []
        for role, g in self.groups.items():
            master = None
            if role == "critic":  # its own process group (DDP over the critic workers): rank 0 is the rendezvous
                master = self.wait_all([g.all_pending("critic group rendezvous", "address")])[0][0][:2]
            pendings.append(g.all_pending(f"{role} group set-up", "setup", plan, start, state, os.getcwd(), master,
                                          g.world))
        self.wait_all(pendings)
        for role, info in zip(self.groups, self.wait_all([g.all_pending(f"{role} group ready check", "ready_info")
                                                          for role, g in self.groups.items()])):
            log.info("Ray: %d %s workers of their own: %s", len(info), role, info)

    # ---- calls --------------------------------------------------------------------------------
    def _call(self, what: str, refs: list, names: list[str]) -> list:
        return self.wait_all([Pending(what, refs, names, [self.node_of[n] for n in names], list)])[0]

    def wait_all(self, pendings: list[Pending]) -> list:
        """The answers of calls started on any of the run's workers (actor workers, role groups),
        awaited together (:func:`~posttrain.cluster.remote.wait_all`); a failure closes every worker."""
        self._check()
        try:
            return wait_all(pendings, self.timeout_s)
        except ClusterError:
            self.close()  # the other workers may wait forever in a collective with the failed one
            raise

    def _all(self, what: str, method: str, *args) -> list:
        return self._call(what, [getattr(w, method).remote(*args) for w in self.workers], self.names)

    def _check(self) -> None:
        if self.closed:
            raise ClusterError("the Ray worker group is closed (an earlier call failed or the run ended)")

    def sharded(self, what: str, method: str, count: int, make_args, collective: bool = True) -> list:
        """Call ``method`` with ``make_args(replica, start, stop)`` for each replica's share, on every
        worker of the replica; the leaders' answers, in order. With FSDP2 a ``collective`` call goes
        to every worker, even with an empty share; on the Megatron backend every call does."""
        return self.wait_all([self.start_sharded(what, method, count, make_args, collective, list)])[0]

    def start_sharded(self, what: str, method: str, count: int, make_args, collective: bool, combine) -> Pending:
        """:meth:`sharded`'s calls, started and not awaited; ``combine`` makes the answer of the
        leaders' results."""
        self._check()
        shares = spans(count, len(self.replicas), keep_empty=self.megatron or (self.fsdp and collective))
        refs, names, leaders = [], [], []
        for r, (lo, hi) in enumerate(shares):
            args = make_args(r, lo, hi)
            leaders.append(len(refs))
            for rank in self.replicas[r]:
                refs.append(getattr(self.workers[rank], method).remote(*args))
                names.append(self.names[rank])
        return Pending(what, refs, names, [self.node_of[n] for n in names],
                       lambda results: combine([results[i] for i in leaders]))

    def update_calls(self, what: str, method: str, batch: dict, loss_fn, mini_batch_size: int, epochs: int,
                     shuffle: bool, seed: int, micro_batch_size: int | None) -> list[dict[str, float]]:
        """An update (actor or critic): every replica's slices of the global mini-batches, to all its
        workers (:func:`update_shards`), each worker's micro-batches of ``micro_batch_size`` rows
        (None: its engine's own); the metrics (the same on every worker) of rank 0."""
        self._check()
        count = next(iter(batch.values())).shape[0]
        shards = update_shards(count, mini_batch_size, len(self.replicas), epochs, shuffle, seed)
        local = mini_batch_size // len(self.replicas)
        refs = []
        for replica, rows in zip(self.replicas, shards):
            part = {k: v[rows].cpu() for k, v in batch.items()}
            refs += [(rank, getattr(self.workers[rank], method).remote(part, loss_fn, local, micro_batch_size))
                     for rank in replica]
        results = self._call(what, [ref for _, ref in refs], [self.names[rank] for rank, _ in refs])
        return results[[rank for rank, _ in refs].index(0)]

    # ---- checkpoints, tests -----------------------------------------------------------------------
    def save(self, save_dir, iteration: int, *, sampler_state, trainer_state: dict, save_optim: bool,
             save_rng: bool):
        self._check()
        # FSDP2: all ranks gather the full state; Megatron: every rank writes its shard
        workers = self.workers if self.fsdp or self.megatron else self.workers[:1]
        refs = [w.save.remote(str(save_dir), iteration, sampler_state, trainer_state, save_optim, save_rng)
                for w in workers]
        answer = self._call("save checkpoint", refs, self.names[:len(refs)])[0]
        if isinstance(answer, dict) and "error" in answer:  # a failed Megatron save, said once by the workers
            raise CheckpointError(answer["error"])
        return Path(answer)

    def state_dicts(self) -> list[dict]:
        self._check()
        return self._all("state_dict", "state_dict")

    def grads(self) -> list[dict]:
        self._check()
        return self._all("grads", "grads")

    def parameter_bytes(self) -> list[dict[str, int]]:
        """Each worker's own parameter storage, trainable and frozen (FSDP2: its shards)."""
        self._check()
        return self._all("parameter bytes", "parameter_bytes")

    def critic_state_dicts(self) -> list[dict]:
        self._check()
        return self._all("critic state_dict", "critic_state_dict")

    def close(self) -> None:
        import ray

        if self.closed:
            return
        self.closed = True
        if self.rewards is not None:
            self.rewards.close()
        for group in self.groups.values():
            group.close()
        for worker in self.workers:
            ray.kill(worker)
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        if self.owns_ray:
            ray.shutdown()


def _rows(batch: dict, lo: int, hi: int) -> dict:
    return {k: v[lo:hi].cpu() for k, v in batch.items()}


class RolloutRole(RolloutEngine):
    """The workers' rollout engines as one :class:`~posttrain.rollout.base.RolloutEngine`."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def generate(self, prompt_token_ids, n, sampling, stop_token_ids=None, prompt_keys=None):
        """Each worker samples its share of the prompts with the call's seed and the shared prompts' keys."""
        keys = list(range(len(prompt_token_ids))) if prompt_keys is None else list(prompt_keys)
        if len(keys) != len(prompt_token_ids):
            raise ConfigError(f"generate(): prompt_keys has {len(keys)} entries for {len(prompt_token_ids)} prompts.")
        if sampling.seed is None:  # one seed for all workers, as one process would draw
            sampling = replace(sampling, seed=random_seed())

        def args(rank, lo, hi):
            return prompt_token_ids[lo:hi], n, sampling, stop_token_ids, keys[lo:hi]

        # FSDP2's parameter gather is a collective for the native engines; vLLM engines need none
        parts = self.c.sharded("rollout", "generate", len(prompt_token_ids), args,
                               collective=not self.c.rollout_holds_weights)
        return [group for part in parts for group in part]

    def sync_weights(self, model) -> int | None:
        """The workers' engines sample from their actors' current weights from now on. vLLM engines
        (their own copy): every worker loads its actor's weights into its engine and proves them
        with the probe; returns the number of tensors one engine loaded (the loop times the sync as
        ``timing/resharding_to_infer``). Native engines: None, nothing to load (they sample from the
        model they train; the Megatron workers' leaders reload their rollout copy at the end of
        every update, timed there). ``model`` is None on the driver."""
        if not self.c.rollout_holds_weights:
            return None
        self.c._check()
        counts = self.c._all("weight sync to the rollout engines", "sync_rollout")
        return int(counts[0])

    def pop_metrics(self) -> dict[str, float]:
        """The engines' metrics of :data:`WORKER_ROLLOUT_METRICS` since the last call, combined over
        the workers (vLLM's ``rollout/sync_probe_diff``: the largest). The native engines' counters
        (speculation's ``rollout/draft_*``, multi-turn's ``timing/tool`` and ``tool/*``) stay in the
        workers that generate (docs/tools.md)."""
        if not self.c.rollout_holds_weights:
            return {}
        self.c._check()
        parts = self.c._all("rollout metrics", "rollout_metrics")
        return {key: reduce([part[key] for part in parts if key in part])
                for key, reduce in WORKER_ROLLOUT_METRICS.items() if any(key in part for part in parts)}


def _sharded_logprobs(cluster: Cluster, batch, temperature, micro_batch_size, reference: bool) -> Pending:
    """The actor's (or the reference's) log-probs of ``batch``, rows cut into one share per replica
    (started; :meth:`Cluster.wait_all` awaits them)."""
    count = next(iter(batch.values())).shape[0]
    what = "reference log-probs" if reference else "actor log-probs"
    return cluster.start_sharded(what, "compute_logprobs", count,
                                 lambda r, lo, hi: (_rows(batch, lo, hi), temperature, micro_batch_size, reference),
                                 not reference, torch.cat)


class ActorRole:
    """The actor in the workers: :class:`~posttrain.train.base.ActorEngine`."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def start_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None) -> Pending:
        return _sharded_logprobs(self.c, batch, temperature, micro_batch_size, reference=False)

    def compute_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None):
        return self.c.wait_all([self.start_logprobs(batch, temperature=temperature,
                                                    micro_batch_size=micro_batch_size)])[0]

    def update(self, batch, loss_fn, *, mini_batch_size, epochs=1, shuffle=False, seed=0, micro_batch_size=None):
        return self.c.update_calls("actor update", "update", batch, loss_fn, mini_batch_size, epochs, shuffle, seed,
                                   micro_batch_size)


class ReferenceRole:
    """The frozen reference in the workers: :class:`~posttrain.train.base.ReferenceEngine`."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def start_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None) -> Pending:
        return _sharded_logprobs(self.c, batch, temperature, micro_batch_size, reference=True)

    def compute_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None):
        return self.c.wait_all([self.start_logprobs(batch, temperature=temperature,
                                                    micro_batch_size=micro_batch_size)])[0]

    def compute_pair_logps(self, batch, *, average=False, micro_batch_size=None):
        """DPO: the reference's (chosen, rejected) sequence log-probs, pairs cut into shares."""
        count = next(iter(batch.values())).shape[0]
        parts = self.c.sharded("reference pair log-probs", "compute_pair_logps", count,
                               lambda r, lo, hi: (_rows(batch, lo, hi), average, micro_batch_size), collective=False)
        return torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts])


class CriticRole:
    """PPO's critic, colocated in the actor workers: values over row shares, the update over every
    worker's slices of each global mini-batch (DDP), as :class:`ActorRole` does for the actor
    (:class:`~posttrain.train.base.CriticEngine`)."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def start_values(self, batch, *, micro_batch_size=None) -> Pending:
        count = next(iter(batch.values())).shape[0]
        return self.c.start_sharded("critic values", "compute_values", count,
                                    lambda r, lo, hi: (_rows(batch, lo, hi), micro_batch_size), False, torch.cat)

    def compute_values(self, batch, *, micro_batch_size=None):
        return self.c.wait_all([self.start_values(batch, micro_batch_size=micro_batch_size)])[0]

    def update(self, batch, loss_fn, *, mini_batch_size, epochs=1, shuffle=False, seed=0, micro_batch_size=None):
        return self.c.update_calls("critic update", "critic_update", batch, loss_fn, mini_batch_size, epochs,
                                   shuffle, seed, micro_batch_size)

    def save(self, iteration: int, *, tokenizer=None, trainer_state: dict):
        """The critic's own checkpoint (``critic_config.save``), from rank 0; None when the critic is
        saved inside the actor's checkpoints."""
        self.c._check()
        path = self.c._call("save critic", [self.c.workers[0].critic_save.remote(iteration, trainer_state)],
                            self.c.names[:1])[0]
        return Path(path) if path is not None else None


class RewardModelRole:
    """``reward_config``'s reward model, colocated in the actor workers: RewardModelScorer's
    ``score_sequences`` over contiguous row shares (no collective)."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def score_sequences(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[float]:
        parts = self.c.sharded("reward model", "score_rewards", len(prompt_ids),
                               lambda r, lo, hi: (prompt_ids[lo:hi], response_ids[lo:hi]), collective=False)
        return [score for part in parts for score in part]
