"""The actor workers as one role: the in-process roles' methods, sharded over Ray actors.

:class:`Cluster` starts (or joins) Ray, places one :class:`~posttrain.cluster.worker.ActorWorker`
per bundle of a placement group, and offers the on-policy loop the same objects an in-process
session has:

* ``rollout.generate(prompts, n, sampling, stop_ids, prompt_keys)``: the prompts are cut into one
  contiguous share per worker, each with its slice of the prompt keys (default: the prompts'
  indices in the whole call) and the same seed (drawn once here when ``sampling.seed`` is None).
  The native engine's sampling is keyed by (seed, prompt key, sample index, token position), so
  the samples are those of one process, whatever the number of workers. Partial rollout's
  continuations are shared out the same way (:mod:`posttrain.cluster.rounds` for its rounds in
  one call), and with ``async_staleness`` the rollout samples the workers' rollout copies
  (:mod:`posttrain.cluster.rollout_copy`; the workers then run two calls at once).
* ``rollout.sync_weights`` / ``rollout.pop_metrics``: where the workers' engines hold their own
  copy of the weights (vLLM), every worker loads its actor's weights into its engine after each update
  (FSDP2: all ranks gather the full parameters once), and each engine's probe metric reaches the
  driver as the maximum over the workers (:data:`WORKER_ROLLOUT_METRICS`). The native engines sample
  from the trained model objects: nothing to load, and their counters stay in the workers.
* ``actor.compute_logprobs`` / ``reference.compute_logprobs``: rows cut into contiguous shares,
  results concatenated in order. With ``rl_config.use_dp_batch_balance`` every pass over rows
  (log-probs, values, reward model, pair log-probs) gives each replica as many rows as the
  contiguous share would, chosen to balance the tokens (:func:`shares`), and puts the answers back
  in row order (:func:`in_order`); the update balances each global mini-batch's slices
  (:func:`update_shards`). The rollout keeps contiguous prompt shares (no lengths yet).
* ``actor.update(batch, loss_fn, mini_batch_size, epochs, shuffle, seed)``: the driver orders the
  rows exactly as :meth:`TrainEngine.update` does (:func:`~posttrain.training.engine.minibatch_order`),
  cuts every mini-batch into ``W`` equal slices and sends worker ``r`` its slices in step order. Each worker
  runs one optimizer step per slice; the engine sums token counts over ranks and DDP averages
  gradients, so every step is the step of the whole global mini-batch.
* A multimodal run (``rl_config.is_multimodal``, docs/multimodal.md): each prompt's images go with
  its rollout share (``generate(images=)``), a batch's ``images`` (:class:`~posttrain.models.vlm.SampleImages`)
  are cut with its rows for every pass and update slice, and ``actor.embed_images`` runs the workers'
  vision towers on shares of the samples (``reuse_image_embeds``). The driver holds the processor.
* ``reference.compute_pair_logps`` (DPO): pairs cut into contiguous shares, as log-probs are.
* ``reward_model.score_sequences`` (``reward_config``): every actor worker loads the reward model;
  rows cut into contiguous shares, scores concatenated in order.
* ``save``: rank 0 writes the full state with :func:`posttrain.checkpoint.save_checkpoint`; the
  checkpoint is the same as an in-process one, so it resumes on any number of workers.

On the Megatron backend (``plan.parallel.backend``) the workers are
:class:`~posttrain.cluster.megatron_worker.MegatronWorker` shards: the rows are cut into one share
per data-parallel *replica* (its TP x PP workers), every worker of a replica gets its replica's
share, and the answer is the replica leader's (the reward model lives in the leaders alone);
``save`` (and a critic's own ``critic_config.save``) is a collective that writes Megatron's layout.

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
from posttrain.cluster.rounds import decode_rounds
from posttrain.cluster.shares import in_order, shares, token_lengths, update_shards
from posttrain.cluster.worker import ActorWorker
from posttrain.errors import CheckpointError, ConfigError
from posttrain.roles.policy import Policy, load_policy_processor, load_policy_tokenizer
from posttrain.rollout.base import RolloutEngine
from posttrain.rollout.keyed import random_seed

log = logging.getLogger(__name__)

# the rollout engines' metrics that reach the driver, and how the workers' values combine into one
WORKER_ROLLOUT_METRICS = {"rollout/sync_probe_diff": max, "timing/resharding_to_train": max}
#: the concurrency of the actor workers of an asynchronous run: the update and the rollout at once
ASYNC_CONCURRENCY = 2


def concurrency(plan) -> int:
    """Calls an actor worker runs at once: with ``async_staleness`` the rollout (on the workers'
    rollout copies) beside the update (cluster/rollout_copy.py), else one at a time."""
    return ASYNC_CONCURRENCY if plan.stage.on_policy and plan.off_policy.staleness is not None else 1


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
        self.balance = plan.cluster.dp_batch_balance  # rl_config.use_dp_batch_balance
        self.world = plan.workers
        self.closed = False
        self.owns_ray = launch.connect(plan.cluster, plan.workers + sum(plan.separated.devices.values()),
                                       extra_cpus=launch.queue_cpus(plan))
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
                           "scheduling_strategy": strategy, "max_concurrency": concurrency(plan)}
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
                             rollout=RolloutRole(self, plan.rollout.max_num_seqs, max_model_len=plan.rollout.max_model_len)
                             if plan.stage.on_policy else None,
                             stop_token_ids=stops, state=states[0],
                             teacher=TeacherRole(self) if plan.distill is not None else None,
                             # a multimodal run: the driver encodes the prompts' images (loops/multimodal.py)
                             processor=load_policy_processor(plan.policy, start["source"]) if plan.multimodal else None,
                             image_token_id=self.info[0].get("image_token_id"))
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

    def row_shares(self, count: int, batch: dict | None = None, collective: bool = True) -> list[torch.Tensor]:
        """Each replica's rows of a pass over ``count`` rows: contiguous shares, or with
        ``rl_config.use_dp_batch_balance`` and a ``batch`` with attention masks, shares of the same
        sizes balanced by tokens. With FSDP2 a ``collective`` pass gives every replica a share, even
        an empty one; on the Megatron backend every pass does."""
        lengths = token_lengths(batch) if self.balance and batch is not None else None
        return shares(count, len(self.replicas), lengths, keep_empty=self.megatron or (self.fsdp and collective))

    def sharded(self, what: str, method: str, rows: list[torch.Tensor], make_args) -> list:
        """Call ``method`` with ``make_args(replica, rows)`` for each replica's share (:meth:`row_shares`),
        on every worker of the replica; the leaders' answers, in share order."""
        return self.wait_all([self.start_sharded(what, method, rows, make_args, list)])[0]

    def start_sharded(self, what: str, method: str, rows: list[torch.Tensor], make_args, combine) -> Pending:
        """:meth:`sharded`'s calls, started and not awaited; ``combine`` makes the answer of the
        leaders' results (in share order)."""
        self._check()
        refs, names, leaders = [], [], []
        for r, share in enumerate(rows):
            args = make_args(r, share)
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
        lengths = token_lengths(batch) if self.balance else None
        shards = update_shards(count, mini_batch_size, len(self.replicas), epochs, shuffle, seed, lengths)
        local = mini_batch_size // len(self.replicas)
        refs = []
        for replica, rows in zip(self.replicas, shards):
            part = _rows(batch, rows)
            refs += [(rank, getattr(self.workers[rank], method).remote(part, loss_fn, local, micro_batch_size))
                     for rank in replica]
        results = self._call(what, [ref for _, ref in refs], [self.names[rank] for rank, _ in refs])
        return results[[rank for rank, _ in refs].index(0)]

    # ---- checkpoints, tests -----------------------------------------------------------------------
    def save(self, save_dir, iteration: int, *, sampler_state, trainer_state: dict, save_optim: bool,
             save_rng: bool, files: dict | None = None):
        """``files``: the loop's objects by file name (partial rollout's dock), written by rank 0."""
        self._check()
        # FSDP2: all ranks gather the full state; Megatron: every rank writes its shard
        workers = self.workers if self.fsdp or self.megatron else self.workers[:1]
        refs = [w.save.remote(str(save_dir), iteration, sampler_state, trainer_state, save_optim, save_rng,
                              files if rank == 0 else None) for rank, w in enumerate(workers)]
        answer = self._call("save checkpoint", refs, self.names[:len(refs)])[0]
        if isinstance(answer, dict) and "error" in answer:  # a failed Megatron save, said once by the workers
            raise CheckpointError(answer["error"])
        return Path(answer)

    def state_dicts(self) -> list[dict]:
        self._check()
        return self._all("state_dict", "state_dict")

    def grads(self, role: str = "actor") -> list[dict]:
        """Each worker's gradients of the actor (or the colocated critic): :meth:`ActorWorker.grads`."""
        self._check()
        return self._all("grads", "grads", role)

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


def _rows(batch: dict, rows: torch.Tensor) -> dict:
    """The rows ``rows`` of a batch, on the CPU (a multimodal batch's ``images`` too: SampleImages)."""
    return {k: v[rows].to("cpu") for k, v in batch.items()}


class RolloutRole(RolloutEngine):
    """The workers' rollout engines as one :class:`~posttrain.rollout.base.RolloutEngine`.

    Partial rollout (:mod:`posttrain.loops.partial_rollout`) calls it as it calls an engine in this
    process: its rounds' continuations (``sample_offsets``, ``position_offsets``) are cut into shares
    as prompts are. Where the workers' engines decode a partial rollout's rounds in one call
    (``supports_rounds``: the native engine), so does this role, with the rounds' check made here
    over every worker's rows (:func:`~posttrain.cluster.rounds.decode_rounds`)."""

    def __init__(self, cluster: Cluster, max_num_seqs: int, method: str = "generate", max_model_len: int | None = None):
        self.c = cluster
        self.max_model_len = max_model_len  # the engines' room for prompt + response (partial rollout's rounds)
        self.supports_rounds = all(i.get("rollout_supports_rounds", False) for i in cluster.info if i["leader"])
        self.max_num_seqs = max_num_seqs  # the rows one process decodes at once (partial rollout's choice)
        # "generate_copy": the workers' rollout copies (async_staleness; cluster/rollout_copy.py), no collective
        self.method = method

    def generate(self, prompt_token_ids, n, sampling, stop_token_ids=None, prompt_keys=None, sample_offsets=None,
                 position_offsets=None, max_new_tokens=None, stop_when=None, stop_every=0, images=None):
        """Each worker samples its share of the prompts with the call's seed and the shared prompts'
        keys (and offsets: a continued response; ``images``: each prompt's, a multimodal run's).
        ``stop_when``: see :func:`~posttrain.cluster.rounds.decode_rounds`."""
        keys = list(range(len(prompt_token_ids))) if prompt_keys is None else list(prompt_keys)
        if len(keys) != len(prompt_token_ids):
            raise ConfigError(f"generate(): prompt_keys has {len(keys)} entries for {len(prompt_token_ids)} prompts.")
        if sampling.seed is None:  # one seed for all workers, as one process would draw
            sampling = replace(sampling, seed=random_seed())
        if stop_when is not None:  # partial rollout's rounds in one call: one call per round here
            return decode_rounds(self.generate, prompt_token_ids, n, sampling, stop_token_ids, keys, sample_offsets,
                                 position_offsets, max_new_tokens, stop_when, stop_every, images, self.max_model_len)
        per_prompt = [sample_offsets, position_offsets, max_new_tokens]  # a continued response's, or None

        def args(rank, share):
            share = share.tolist()
            out = ([prompt_token_ids[i] for i in share], n, sampling, stop_token_ids, [keys[i] for i in share],
                   *[None if values is None else [list(values)[i] for i in share] for values in per_prompt])
            return out if images is None else (*out, [images[i] for i in share])  # a multimodal run's

        # contiguous shares (the responses' lengths are not known yet); FSDP2's parameter gather is a
        # collective for the native engines on the trained weights; vLLM engines and rollout copies need none
        rows = self.c.row_shares(len(prompt_token_ids),
                                 collective=self.method == "generate" and not self.c.rollout_holds_weights)
        parts = self.c.sharded("rollout", self.method, rows, args)
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

    def drop_sampling_weights(self) -> int:
        """The workers' native engines free the weights only sampling reads (packs, a bf16 sampling
        copy's) before the update (as :class:`~posttrain.rollout.native.NativeEngine`'s in one process,
        called by ``loops.sources.SyncSource``); the number of tensors freed over the workers. Rollout
        copies (``generate_copy``) and vLLM engines keep theirs."""
        if self.method != "generate" or self.c.rollout_holds_weights:
            return 0
        self.c._check()
        return sum(self.c._all("sampling weights freed", "drop_sampling_weights"))

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


def _sharded_logprobs(cluster: Cluster, batch, temperature, micro_batch_size, reference: bool,
                      teacher: bool = False) -> Pending:
    """The actor's (or the reference's, or the distillation teacher's) log-probs of ``batch``, rows
    cut into one share per replica and put back in the batch's row order (started;
    :meth:`Cluster.wait_all` awaits them)."""
    count = next(iter(batch.values())).shape[0]
    what = "teacher log-probs" if teacher else "reference log-probs" if reference else "actor log-probs"
    rows = cluster.row_shares(count, batch, collective=not (reference or teacher))
    flags = (reference, True) if teacher else (reference,)  # the megatron worker has no teacher (compat.py)
    return cluster.start_sharded(what, "compute_logprobs", rows,
                                 lambda r, share: (_rows(batch, share), temperature, micro_batch_size, *flags),
                                 lambda parts: in_order(parts, rows))


class ActorRole:
    """The actor in the workers: :class:`~posttrain.training.base.ActorEngine`."""

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

    def release_gradients(self) -> None:
        """The workers free their actors' (and colocated critics') gradients after the update, as the
        loop does in one process (``OnPolicyTrainer.release_gradients``)."""
        self.c._check()
        self.c._all("gradients freed", "release_gradients")

    def embed_images(self, pixel_values: list, image_grid_thw: list, *, vit_micro_batch_size=None,
                     pixel_values_videos: list = (), video_grid_thw: list = ()) -> list:
        """``reuse_image_embeds``: each sample's image (and video) embeddings from the workers' vision
        towers (contiguous shares of the samples, no collective), in the samples' order."""
        rows = self.c.row_shares(len(pixel_values), collective=False)

        def pick(cells: list, share: torch.Tensor) -> list:  # the share's cells (none given: none)
            return [cells[i] for i in share.tolist()] if len(cells) else []

        parts = self.c.sharded("image embeddings", "embed_images", rows, lambda r, share: (
            pick(pixel_values, share), pick(image_grid_thw, share), vit_micro_batch_size,
            pick(pixel_values_videos, share), pick(video_grid_thw, share)))
        out = [None] * len(pixel_values)
        for share, part in zip(rows, parts):
            for i, embeds in zip(share.tolist(), part):
                out[i] = embeds
        return out


class ReferenceRole:
    """The frozen reference in the workers: :class:`~posttrain.training.base.ReferenceEngine`."""

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
        rows = self.c.row_shares(count, batch, collective=False)
        parts = self.c.sharded("reference pair log-probs", "compute_pair_logps", rows,
                               lambda r, share: (_rows(batch, share), average, micro_batch_size))
        return in_order([c for c, _ in parts], rows), in_order([r for _, r in parts], rows)


class TeacherRole(ReferenceRole):
    """On-policy distillation's frozen teacher, a copy in every actor worker (``rl_config.teacher_model``)."""

    def start_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None) -> Pending:
        return _sharded_logprobs(self.c, batch, temperature, micro_batch_size, reference=False, teacher=True)


class CriticRole:
    """PPO's critic, colocated in the actor workers: values over row shares, the update over every
    worker's slices of each global mini-batch (DDP), as :class:`ActorRole` does for the actor
    (:class:`~posttrain.training.base.CriticEngine`)."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def start_values(self, batch, *, micro_batch_size=None) -> Pending:
        count = next(iter(batch.values())).shape[0]
        rows = self.c.row_shares(count, batch, collective=False)
        return self.c.start_sharded("critic values", "compute_values", rows,
                                    lambda r, share: (_rows(batch, share), micro_batch_size),
                                    lambda parts: in_order(parts, rows))

    def compute_values(self, batch, *, micro_batch_size=None):
        return self.c.wait_all([self.start_values(batch, micro_batch_size=micro_batch_size)])[0]

    def update(self, batch, loss_fn, *, mini_batch_size, epochs=1, shuffle=False, seed=0, micro_batch_size=None):
        return self.c.update_calls("critic update", "critic_update", batch, loss_fn, mini_batch_size, epochs,
                                   shuffle, seed, micro_batch_size)

    def save(self, iteration: int, *, tokenizer=None, trainer_state: dict):
        """The critic's own checkpoint (``critic_config.save``), from rank 0 (Megatron: a collective,
        every rank writes its shard); None when the critic is saved inside the actor's checkpoints."""
        self.c._check()
        workers = self.c.workers if self.c.megatron else self.c.workers[:1]
        refs = [w.critic_save.remote(iteration, trainer_state) for w in workers]
        path = self.c._call("save critic", refs, self.c.names[:len(refs)])[0]
        if isinstance(path, dict) and "error" in path:  # a failed Megatron save, said once by the workers
            raise CheckpointError(path["error"])
        return Path(path) if path is not None else None


class RewardModelRole:
    """``reward_config``'s reward model, colocated in the actor workers: RewardModelScorer's
    ``score_sequences`` over row shares (contiguous, or balanced by tokens with
    ``use_dp_batch_balance``; no collective)."""

    def __init__(self, cluster: Cluster):
        self.c = cluster

    def score_sequences(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[float]:
        lengths = {"attention_mask": torch.tensor([[len(p) + len(r)] for p, r in zip(prompt_ids, response_ids)])}
        rows = self.c.row_shares(len(prompt_ids), lengths, collective=False)
        parts = self.c.sharded("reward model", "score_rewards", rows,
                               lambda r, share: ([prompt_ids[i] for i in share.tolist()],
                                                [response_ids[i] for i in share.tolist()]))
        return in_order([torch.tensor(part, dtype=torch.float64) for part in parts], rows).tolist()
