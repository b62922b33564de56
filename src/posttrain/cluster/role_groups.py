"""The seed's separated roles: the frozen reference and the reward model in Ray worker groups of their own.

``rl_config.use_integrated_worker: false`` with ``reference_resource.num_npus: R`` (or
``reward_resource``) gives the role a :class:`RoleGroup`: R :class:`RoleWorker` Ray actors in a
placement group of their own (one bundle each, as the actor workers'), each building only its role
(:func:`~posttrain.roles.policy.build_reference`: the frozen reference of ``ref_config.load``, else
a copy of the actor's initial weights; :func:`~posttrain.roles.reward_model.build_reward_scorer`).
The driver's loop is unchanged: it calls :class:`GroupReference` and :class:`GroupRewardModel`,
which cut the rows of each call into R contiguous shares (as the actor group does,
:func:`~posttrain.cluster.group.spans`) and concatenate the answers in order; the data meets in the
driver's TransferDock. Each call can also be started without waiting (``start_*``, a
:class:`~posttrain.cluster.remote.Pending`): ``rl_config.blocking: false`` starts the independent
passes of an iteration together and waits for all of them in one
:func:`~posttrain.cluster.remote.wait_all` (:mod:`posttrain.loops.overlap`).

The workers need no collective: the reference and the reward model are frozen, and each worker
answers its own share. This module is imported inside Ray worker processes.
"""

from __future__ import annotations

import os

import torch

from posttrain.cluster import launch
from posttrain.cluster.remote import Pending
from posttrain.models.cpu_linear import set_cpu_linear
from posttrain.roles.policy import build_reference, load_policy_tokenizer, seed_everything
from posttrain.roles.reward_model import build_reward_scorer

ROLE_NAMES = {"reference": "reference", "reward": "reward model"}


def _spans(count: int, parts: int) -> list[tuple[int, int]]:
    bounds = [count * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i + 1] > bounds[i]]


class RoleWorker:
    """One worker of a role group (created with ``ray.remote``): the frozen reference or the reward model."""

    def __init__(self, role: str, rank: int, cpu_threads: int):
        self.role, self.rank, self.cpu_threads = role, rank, cpu_threads
        self.reference = self.scorer = None

    def setup(self, plan, start: dict, state: dict, cwd: str) -> None:
        """Build this worker's role on its device (the trainer state ``state`` says, after a resume,
        which initial model the reference copies)."""
        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative paths of the config mean the same here
        self.device = plan.device
        if self.device.startswith("cuda"):  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
            torch.cuda.set_device(0)
            self.device = "cuda:0"
        else:
            torch.set_num_threads(self.cpu_threads)
            set_cpu_linear(start["cpu_linear"])  # for the worker's life: the run's fp32 linear kernel
        seed_everything(plan.policy.seed)
        if plan.policy.deterministic:
            torch.use_deterministic_algorithms(True)
        if self.role == "reference":
            self.reference = build_reference(plan, self.device, start["source"], state,
                                             plan.separated.reference_micro_batch_size)
        else:
            tokenizer, _ = load_policy_tokenizer(plan.policy, start["source"])
            self.scorer = build_reward_scorer(plan.reward_model, tokenizer, self.device)

    def ready_info(self) -> dict:
        from posttrain.cluster.worker import worker_node_id

        return {"role": self.role, "rank": self.rank, "pid": os.getpid(), "node": worker_node_id(),
                "device": self.device, "threads": torch.get_num_threads()}

    def compute_logprobs(self, batch: dict, temperature: float, micro_batch_size) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        return self.reference.compute_logprobs(batch, temperature=temperature, micro_batch_size=micro_batch_size).cpu()

    def score_rewards(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[float]:
        return [float(s) for s in self.scorer.score_sequences(prompt_ids, response_ids)]


class RoleGroup:
    """``count`` :class:`RoleWorker` of one role, in a placement group of their own."""

    def __init__(self, role: str, count: int, plan, start: dict, state: dict):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role, self.world, self.timeout_s = role, count, plan.cluster.timeout_s
        self.workers: list = []
        self.pg, self.closed = None, False
        use_gpu, cpus = plan.device.startswith("cuda"), plan.cluster.cpus_per_worker
        try:
            self.pg = launch.placement_group(count, use_gpu, cpus, self.timeout_s)
            remote = ray.remote(RoleWorker)
            for rank in range(count):
                strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
                options = {"num_cpus": 1 if use_gpu else cpus, "num_gpus": 1 if use_gpu else 0, "max_restarts": 0,
                           "scheduling_strategy": strategy}
                self.workers.append(remote.options(**options).remote(role, rank, cpus))
            self.nodes = launch.bundle_nodes(self.pg)
        except BaseException:
            self.close()
            raise
        self.names = [f"{ROLE_NAMES[role]} worker rank {r} on {launch.node_label(n)}" for r, n in enumerate(self.nodes)]

    def all_pending(self, what: str, method: str, *args) -> Pending:
        return Pending(what, [getattr(w, method).remote(*args) for w in self.workers], list(self.names),
                       list(self.nodes), list)

    def sharded(self, what: str, method: str, count: int, make_args, combine) -> Pending:
        """``method`` on each worker with ``make_args(start, stop)`` of its contiguous share of
        ``count`` rows, not awaited; ``combine`` makes the answer of the shares' results."""
        shares = _spans(count, self.world)
        refs = [getattr(self.workers[r], method).remote(*make_args(lo, hi)) for r, (lo, hi) in enumerate(shares)]
        return Pending(what, refs, self.names[:len(refs)], self.nodes[:len(refs)], combine)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.closed:
            return
        self.closed = True
        for worker in self.workers:
            ray.kill(worker)
        if self.pg is not None:
            remove_placement_group(self.pg)


def _rows(batch: dict, lo: int, hi: int) -> dict:
    return {k: v[lo:hi].cpu() for k, v in batch.items()}


class GroupReference:
    """The reference group as the loop's :class:`~posttrain.train.base.ReferenceEngine`; ``cluster``
    awaits the calls (its timeout; a failure closes the whole run's workers)."""

    def __init__(self, cluster, group: RoleGroup):
        self.c, self.group = cluster, group

    def start_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None) -> Pending:
        count = next(iter(batch.values())).shape[0]
        return self.group.sharded("reference log-probs", "compute_logprobs", count,
                                  lambda lo, hi: (_rows(batch, lo, hi), temperature, micro_batch_size), torch.cat)

    def compute_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None):
        return self.c.wait_all([self.start_logprobs(batch, temperature=temperature,
                                                    micro_batch_size=micro_batch_size)])[0]


class GroupRewardModel:
    """The reward-model group with RewardModelScorer's ``score_sequences``."""

    def __init__(self, cluster, group: RoleGroup):
        self.c, self.group = cluster, group

    def start_scores(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> Pending:
        return self.group.sharded("reward model", "score_rewards", len(prompt_ids),
                                  lambda lo, hi: (prompt_ids[lo:hi], response_ids[lo:hi]),
                                  lambda parts: [score for part in parts for score in part])

    def score_sequences(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[float]:
        return self.c.wait_all([self.start_scores(prompt_ids, response_ids)])[0]
