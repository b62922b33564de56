"""The seed's separated roles: the reference, the reward model and PPO's critic in Ray worker groups of their own.

``rl_config.use_integrated_worker: false`` with ``reference_resource.num_npus: R`` (or
``reward_resource``, ``critic_resource``) gives the role a :class:`RoleGroup`: R :class:`RoleWorker`
Ray actors in a placement group of their own (one bundle each, as the actor workers'), each
building only its role (:func:`~posttrain.roles.policy.build_reference`: the frozen reference of
``ref_config.load``, else a copy of the actor's initial weights;
:func:`~posttrain.roles.reward_model.build_reward_scorer`; :func:`build_group_critic`). The
driver's loop is unchanged: it calls :class:`GroupReference`, :class:`GroupRewardModel` and
:class:`GroupCritic`, which cut the rows of each call into R contiguous shares (as the actor group
does, :func:`~posttrain.cluster.shares.spans`) and concatenate the answers in order, and cut each
critic update's mini-batches into R equal slices (:func:`~posttrain.cluster.shares.update_shards`);
the data meets in the driver's TransferDock. Each call can also be started without waiting (``start_*``, a
:class:`~posttrain.cluster.remote.Pending`): ``rl_config.blocking: false`` starts the independent
passes of an iteration together and waits for all of them in one
:func:`~posttrain.cluster.remote.wait_all` (:mod:`posttrain.loops.overlap`).

The frozen roles need no collective: each worker answers its own share. The critic's workers join
a process group of their own and train through DDP over it; the critic saves checkpoints of its
own (``critic_config.save``, from rank 0). This module is imported inside Ray worker processes.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.cluster import launch
from posttrain.cluster.remote import Pending
from posttrain.cluster.shares import spans, update_shards
from posttrain.cluster.worker import free_port, worker_node_id, wrap_ddp
from posttrain.config.separated import ROLE_RESOURCES
from posttrain.models.packed_linear import install_run_kernels
from posttrain.roles.critic import Critic
from posttrain.roles.policy import build_reference, load_policy_tokenizer, seed_everything
from posttrain.roles.reward_model import build_reward_scorer
from posttrain.training.engine import TrainEngine

ROLE_NAMES = {"reference": "reference", "reward": "reward model", "critic": "critic"}


class RoleWorker:
    """One worker of a role group (created with ``ray.remote``): the frozen reference, the reward
    model, or a data-parallel rank of PPO's critic."""

    def __init__(self, role: str, rank: int, cpu_threads: int):
        self.role, self.rank, self.cpu_threads = role, rank, cpu_threads
        self.reference = self.scorer = self.critic = None

    def address(self) -> tuple[str, int, int]:
        """(node IP, a free port, pid): the critic group's rank 0 is its process group's rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port(), os.getpid()

    def setup(self, plan, start: dict, state: dict, cwd: str, master: tuple[str, int] | None = None,
              world: int = 1) -> None:
        """Build this worker's role on its device (the trainer state ``state`` says, after a resume,
        which initial model the reference and the critic start from); the critic's ``world``
        workers first join a process group of their own at ``master``."""
        if os.path.isdir(cwd):
            os.chdir(cwd)  # relative paths of the config mean the same here
        self.device = plan.device
        if self.device.startswith("cuda"):  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
            torch.cuda.set_device(0)
            self.device = "cuda:0"
        else:
            torch.set_num_threads(self.cpu_threads)
            install_run_kernels(start)  # for the worker's life: the run's fp32 kernel and packing choice
        seed_everything(plan.policy.seed)
        if plan.policy.deterministic:
            torch.use_deterministic_algorithms(True)
        if self.role == "reference":
            self.reference = build_reference(plan, self.device, start["source"], state,
                                             plan.separated.reference_micro_batch_size)
            return
        self.tokenizer, _ = load_policy_tokenizer(plan.policy, start["source"])
        if self.role == "reward":
            self.scorer = build_reward_scorer(plan.reward_model, self.tokenizer, self.device)
        else:
            self.critic = build_group_critic(plan, state, self.device, master, self.rank, world)

    def ready_info(self) -> dict:
        return {"role": self.role, "rank": self.rank, "pid": os.getpid(), "node": worker_node_id(),
                "device": self.device, "threads": torch.get_num_threads()}

    def compute_logprobs(self, batch: dict, temperature: float, micro_batch_size) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        return self.reference.compute_logprobs(batch, temperature=temperature, micro_batch_size=micro_batch_size).cpu()

    def score_rewards(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[float]:
        return [float(s) for s in self.scorer.score_sequences(prompt_ids, response_ids)]

    def compute_values(self, batch: dict, micro_batch_size) -> torch.Tensor:
        batch = {k: v.to(self.device) for k, v in batch.items()}
        return self.critic.compute_values(batch, micro_batch_size=micro_batch_size).cpu()

    def critic_update(self, batch: dict, loss_fn, mini_batch_size: int, micro_batch_size) -> list[dict[str, float]]:
        """The critic's optimizer steps on this rank's slices of the global mini-batches (DDP over the group)."""
        return self.critic.update(batch, loss_fn, mini_batch_size=mini_batch_size, epochs=1, shuffle=False,
                                  micro_batch_size=micro_batch_size)

    def critic_save(self, iteration: int, trainer_state: dict) -> str | None:
        path = self.critic.save(iteration, tokenizer=self.tokenizer, trainer_state=trainer_state)
        return str(path) if path is not None else None

    def critic_state_dict(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.critic.model.state_dict().items()}


def build_group_critic(plan, state: dict, device: str, master: tuple[str, int], rank: int, world: int) -> Critic:
    """PPO's critic in a group of its own: the group's ``world`` workers join a process group of
    their own (gloo on a CPU, nccl on CUDA); values on the plain model, the update through DDP."""
    timeout = datetime.timedelta(seconds=plan.cluster.timeout_s)
    use_gpu = device.startswith("cuda")
    dist.init_process_group("nccl" if use_gpu else "gloo", init_method=f"tcp://{master[0]}:{master[1]}", rank=rank,
                            world_size=world, timeout=timeout)
    own = [dist.new_group([r], timeout=timeout) for r in range(world)][rank]  # values: no collective
    critic = Critic(plan, state, device)
    critic.infer = TrainEngine(critic.engine.model, micro_batch_size=critic.micro_batch_size, dtype=plan.train_dtype,
                               dp_group=own, metric_prefix="critic")
    critic.engine.model = wrap_ddp(critic.engine.model, [0] if use_gpu else None)
    return critic


class RoleGroup:
    """``count`` :class:`RoleWorker` of one role, in a placement group of their own."""

    def __init__(self, role: str, count: int, plan):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role, self.world, self.timeout_s = role, count, plan.cluster.timeout_s
        self.workers: list = []
        self.pg, self.closed = None, False
        use_gpu, cpus = plan.device.startswith("cuda"), plan.cluster.cpus_per_worker
        try:
            self.pg = launch.placement_group(count, use_gpu, cpus, self.timeout_s, f"{ROLE_NAMES[role]} workers",
                                             ROLE_RESOURCES[role])
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
        shares = spans(count, self.world)
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
    """The reference group's ``compute_logprobs``: the on-policy part of
    :class:`~posttrain.training.base.ReferenceEngine` (DPO's pair log-probs are not offered: the
    offline stages refuse separated roles); ``cluster`` awaits the calls (its timeout; a failure
    closes the whole run's workers)."""

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


class GroupCritic:
    """PPO's critic group as the loop's :class:`~posttrain.training.base.CriticEngine`: values over
    contiguous row shares; the update over every worker's slices of each global mini-batch
    (:func:`~posttrain.cluster.shares.update_shards`; DDP over the group averages the gradients),
    as the colocated critic's; its checkpoints from rank 0 (``critic_config.save``)."""

    def __init__(self, cluster, group: RoleGroup):
        self.c, self.group = cluster, group

    def start_values(self, batch, *, micro_batch_size=None) -> Pending:
        count = next(iter(batch.values())).shape[0]
        return self.group.sharded("critic values", "compute_values", count,
                                  lambda lo, hi: (_rows(batch, lo, hi), micro_batch_size), torch.cat)

    def compute_values(self, batch, *, micro_batch_size=None):
        return self.c.wait_all([self.start_values(batch, micro_batch_size=micro_batch_size)])[0]

    def update(self, batch, loss_fn, *, mini_batch_size, epochs=1, shuffle=False, seed=0, micro_batch_size=None):
        g = self.group
        count = next(iter(batch.values())).shape[0]
        shards = update_shards(count, mini_batch_size, g.world, epochs, shuffle, seed)
        local = mini_batch_size // g.world
        refs = [w.critic_update.remote({k: v[rows].cpu() for k, v in batch.items()}, loss_fn, local, micro_batch_size)
                for w, rows in zip(g.workers, shards)]
        return self.c.wait_all([Pending("critic update", refs, list(g.names), list(g.nodes), list)])[0][0]

    def save(self, iteration: int, *, tokenizer=None, trainer_state: dict):
        """The critic's own checkpoint (``critic_config.save``), written by rank 0."""
        g = self.group
        ref = g.workers[0].critic_save.remote(iteration, trainer_state)
        path = self.c.wait_all([Pending("save critic", [ref], g.names[:1], g.nodes[:1], list)])[0][0]
        return Path(path) if path is not None else None

    def state_dicts(self) -> list[dict]:
        """Every critic worker's weights (for tests: DDP keeps them equal)."""
        return self.c.wait_all([self.group.all_pending("critic state_dict", "critic_state_dict")])[0]
