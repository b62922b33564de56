"""The actor worker: one process per device (or per CPU worker), holding a full copy of the policy.

Each worker builds what the in-process session builds (:func:`posttrain.roles.policy.build_policy`:
the actor model and its :class:`~posttrain.training.engine.TrainEngine`, the optional frozen reference,
the rollout engine of ``rl_config.rollout_engine``; colocated with them PPO's critic and the
frozen reward model of ``reward_config``), joins a torch.distributed group (gloo on CPU, nccl on
GPU) and wraps the model in DistributedDataParallel for the update (or shards it with FSDP2,
:mod:`posttrain.cluster.fsdp`; with LoRA the PEFT model, frozen base included). Inference
(rollout, log-probs, reference) uses the unwrapped model and needs no collective (FSDP2: after one
parameter gather per call), so the driver may give workers uneven shares; the update is a collective: every worker gets a slice of
every mini-batch (see :mod:`posttrain.cluster.group`).

Rollout engines. The native engine samples from the actor's model object itself. A vLLM engine
(``rollout_engine: vllm``, in this worker's process) holds its own copy, started from this worker's
weights: after every update the driver calls :meth:`ActorWorker.sync_rollout` on every worker (DDP:
each loads its own replica; FSDP2: all ranks gather the full parameters once, a collective, and each
rank's engine loads them), and every engine proves its copy with its probe
(``rollout/sync_probe_diff``, collected by :meth:`ActorWorker.rollout_metrics`). The worker's torch
thread count is exported as ``OMP_NUM_THREADS`` first, which vLLM keeps for its CPU worker. With
``async_staleness`` the driver never calls ``sync_rollout`` during training: the engine loads the
snapshot of the version the pipeline asks for (:class:`~posttrain.cluster.rollout_copy.EngineCopy`).

This module is imported inside Ray worker processes; the ``ray.remote`` wrapping is done by the group.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from posttrain.checkpoint import save_checkpoint
from posttrain.cluster import fsdp
from posttrain.cluster.fsdp import FullCopy, full_state, gathered
from posttrain.cluster.rollout_copy import EngineCopy, RolloutCopy
from posttrain.models.cpu_linear import installed
from posttrain.models.packed_linear import install_run_kernels
from posttrain.roles.critic import Critic
from posttrain.roles.policy import build_policy, build_rollout, seed_everything
from posttrain.roles.reward_model import build_reward_scorer
from posttrain.training.engine import TrainEngine, release_gradients_of
from posttrain.training.offload import on_device
from posttrain.training.sample_embeds import embed_samples

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def worker_node_id() -> str:
    """The Ray node this worker runs on (the tests check that a placement spreads over nodes)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def wrap_ddp(model, device_ids):
    """DDP without buffer syncs in forward (the rotary buffers are equal on all ranks, and the
    log-prob passes must not need a collective); torch >= 2.13 names the option forward_sync_buffers.
    Every trainable weight gets a gradient at each backward (a text-only micro-batch gives a trained
    vision tower a zero one: :func:`posttrain.training.multimodal.tower_anchor`)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    option = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return DistributedDataParallel(model, device_ids=device_ids, **{option: False})


def _full(tensor):
    """A CPU copy of a tensor, gathered first when it is an FSDP2 shard (DTensor)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().cpu().clone()


def continued(sample_offsets, position_offsets, max_new_tokens, images=None) -> dict:
    """The keyword arguments of a continued response (partial rollout), and the prompts' images (a
    multimodal run), that were given."""
    given = {"sample_offsets": sample_offsets, "position_offsets": position_offsets, "max_new_tokens": max_new_tokens,
             "images": images}
    return {name: values for name, values in given.items() if values is not None}


class ActorWorker:
    """Rank ``rank`` of ``world_size`` data-parallel policy workers."""

    def __init__(self, rank: int, world_size: int, cpu_threads: int):
        self.rank, self.world_size, self.cpu_threads = rank, world_size, cpu_threads
        self.policy = None
        self.rollout_holds_weights = False

    # ---- set-up ---------------------------------------------------------------------------------
    def address(self) -> tuple[str, int, int]:
        """(node IP, a free port, pid): rank 0's become the rendezvous of the process group."""
        import ray

        return ray.util.get_node_ip_address(), free_port(), os.getpid()

    def join(self, plan, start: dict, master: tuple[str, int], timeout_s: float, cwd: str) -> datetime.timedelta:
        """Take the driver's working directory (relative paths in the config mean the same here;
        multi-node: same paths on every node), pick the device (on a CPU with the run's linear
        kernel, ``start["cpu_linear"]``), join the process group (gloo on a CPU, nccl on CUDA) and
        seed the generators; returns the collectives' timeout."""
        if os.path.isdir(cwd):
            os.chdir(cwd)
        self.device = plan.device
        use_gpu = self.device.startswith("cuda")
        if use_gpu:  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
            torch.cuda.set_device(0)
            self.device = "cuda:0"
        else:
            torch.set_num_threads(self.cpu_threads)
            os.environ["OMP_NUM_THREADS"] = str(self.cpu_threads)  # a vLLM engine's CPU worker keeps this count
            install_run_kernels(start)  # for the worker's life: the run's fp32 kernel and packing choice
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("nccl" if use_gpu else "gloo", init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=self.rank, world_size=self.world_size, timeout=timeout)
        seed_everything(plan.policy.seed)
        if plan.policy.deterministic:
            torch.use_deterministic_algorithms(True)
        return timeout

    def setup(self, plan, start: dict, master: tuple[str, int], timeout_s: float, cwd: str) -> dict:
        """Join the process group, build the policy (from ``start["source"]``, the checkpoint the
        driver checked), wrap it in DDP. Rank 0 returns the trainer state (resumed or fresh); the
        others return {}."""
        timeout = self.join(plan, start, master, timeout_s, cwd)
        use_gpu, device = self.device.startswith("cuda"), self.device
        # one single-rank group per rank (created by all ranks, in order): inference engines use
        # their own, so log-prob passes never wait on other ranks (uneven shares are fine)
        own = [dist.new_group([r], timeout=timeout) for r in range(self.world_size)][self.rank]
        own = plan.separated.devices  # roles in worker groups of their own (cluster/role_groups.py) are not built here
        self.policy = p = build_policy(plan, device, source=start["source"], with_rollout=plan.stage.on_policy,
                                       with_reference="reference" not in own)
        # vLLM: its own copy of the weights, started from this worker's (before FSDP2 shards them)
        self.rollout_holds_weights = bool(getattr(p.rollout, "holds_weights", False))
        self.adapter_only = plan.schedule.adapter_only  # LoRA: save the adapter alone
        # log-probs on the plain model, no collective; the update through DDP over all ranks
        self.infer = TrainEngine(p.model, micro_batch_size=plan.policy.optim.micro_batch_size,
                                 dtype=plan.train_dtype, dp_group=own, options=plan.actor_engine)
        for frozen in (p.reference, p.teacher):  # the reference; on-policy distillation's teacher
            if frozen is not None:
                frozen.dp_group = own
        # share_backbone (LoRA): the reference is the actor's own (sharded, under FSDP2) model, adapter off
        self.reference_is_actor = plan.uses_reference and plan.policy.share_backbone
        self.fsdp = plan.sharding == "fsdp2"
        self.copy = None
        if plan.stage.on_policy and plan.off_policy.staleness is not None:  # async_staleness: the rollout's copy
            self.copy = EngineCopy(p.rollout) if self.rollout_holds_weights else RolloutCopy(
                p.model, lambda m: build_rollout(plan.rollout, plan.policy, m, p.tokenizer, p.stop_token_ids),
                None if use_gpu else self.cpu_threads)  # full: made before FSDP2 shards
        if self.fsdp:  # parameters, gradients and optimizer state sharded (cluster/fsdp.py)
            self.param_names = fsdp.shard(p.model, p.actor, plan.policy.optim, plan.total_optimizer_steps)
        else:
            p.actor.model = wrap_ddp(p.model, [0] if use_gpu else None)
        self.critic = None
        if plan.uses_critic and "critic" not in own:  # PPO: colocated with the actor, data parallel over its ranks
            self.critic = c = Critic(plan, p.state, device)
            c.infer = TrainEngine(c.engine.model, micro_batch_size=c.micro_batch_size, dtype=plan.train_dtype,
                                  dp_group=own, metric_prefix="critic")
            c.engine.model = wrap_ddp(c.engine.model, [0] if use_gpu else None)
        self.reward_model = None
        if plan.stage.on_policy and plan.reward_model is not None and "reward" not in own:  # colocated, frozen
            self.reward_model = build_reward_scorer(plan.reward_model, p.tokenizer, device)
        return dict(p.state) if self.rank == 0 else {}

    def ready_info(self) -> dict:
        """Who this worker is; ``replica``: its data-parallel replica (every worker is one here)."""
        return {"rank": self.rank, "pid": os.getpid(), "node": worker_node_id(), "threads": torch.get_num_threads(),
                "device": self.device, "replica": self.rank, "leader": True, "cpu_linear": installed(),
                "rollout_holds_weights": self.rollout_holds_weights,
                "rollout_supports_rounds": bool(getattr(self.policy.rollout, "supports_rounds", False)),
                "image_token_id": self.policy.image_token_id}

    # ---- roles ----------------------------------------------------------------------------------
    def _gathered(self, needed: bool = True):
        return gathered(self.policy.model, self.fsdp and needed)

    def generate(self, prompts: list[list[int]], n: int, sampling, stop_token_ids, prompt_keys=None,
                 sample_offsets=None, position_offsets=None, max_new_tokens=None, images=None) -> list:
        """This worker's share of a rollout; ``prompt_keys`` are the prompts' keys in the whole
        call, so the samples are those one process would draw. ``sample_offsets``,
        ``position_offsets``, ``max_new_tokens``: a continued response's (partial rollout), this
        share's, passed to the engine when given; ``images``: the prompts' images (a multimodal run,
        the native engine's ``generate(images=)``). FSDP2 with the native engine: every rank enters
        the parameter gather, even with no prompts (a vLLM engine needs no gather)."""
        with self._gathered(not self.rollout_holds_weights):
            if not prompts:
                return []
            return self.policy.rollout.generate(prompts, n, sampling, stop_token_ids, prompt_keys=prompt_keys,
                                                **continued(sample_offsets, position_offsets, max_new_tokens, images))

    def generate_copy(self, prompts: list[list[int]], n: int, sampling, stop_token_ids, prompt_keys=None,
                      sample_offsets=None, position_offsets=None, max_new_tokens=None, images=None) -> list:
        """:meth:`generate` on the rollout copy of the weights (``async_staleness``): no collective,
        and it may run while an update runs in the actor's other thread (``images``: as :meth:`generate`'s)."""
        if not prompts:
            return []
        return self.copy.generate(prompts, n, sampling, stop_token_ids, prompt_keys=prompt_keys,
                                  **continued(sample_offsets, position_offsets, max_new_tokens, images))

    def snapshot_copy(self, version: int) -> None:
        """Keep the trained weights now as snapshot ``version`` of the rollout copy (FSDP2: the full
        tensors, a collective over all ranks). A vLLM engine's snapshot also scores the engine's probe
        on these weights (:class:`~posttrain.cluster.rollout_copy.EngineCopy`)."""
        if not isinstance(self.copy, EngineCopy):
            self.copy.keep(version, {name: _full(value) for name, value in self.policy.model.state_dict().items()})
        elif not self.fsdp:
            self.copy.keep(version, self.policy.model)
        else:
            with self._gathered():
                self.copy.keep(version, fsdp.GatheredView(self.policy.model))

    def load_copy(self, version: int) -> int:
        """The rollout copy samples snapshot ``version`` from now on."""
        return self.copy.load(version)

    def sync_rollout(self) -> int | None:
        """Load the actor's current weights into this worker's rollout engine and prove them with
        its probe (vLLM; the native engine samples from the model itself: None). DDP: this
        worker's replica; FSDP2: the full parameters, gathered once on every rank (a collective:
        the driver calls every worker). Returns the number of tensors loaded."""
        if not self.rollout_holds_weights:
            return None
        if not self.fsdp:
            return self.policy.rollout.sync_weights(self.policy.model)
        with self._gathered():
            return self.policy.rollout.sync_weights(fsdp.GatheredView(self.policy.model))

    def rollout_metrics(self) -> dict[str, float]:
        """This worker's rollout engine's metrics since the last call (vLLM: ``rollout/sync_probe_diff``)."""
        return self.policy.rollout.pop_metrics() if self.policy.rollout is not None else {}

    def compute_logprobs(self, batch: dict, temperature: float, micro_batch_size, reference: bool = False,
                         teacher: bool = False):
        """This worker's share of the actor's log-probs, or the reference's, or (``teacher``) on-policy
        distillation's teacher's (a frozen copy of its own in every worker)."""
        engine = self.policy.teacher if teacher else self.policy.reference if reference else self.infer
        rows, width = batch["response_mask"].shape
        with self._gathered(not (reference or teacher) or (reference and self.reference_is_actor)):  # else a frozen copy
            if rows == 0:
                return torch.zeros(0, width)
            batch = {k: v.to(self.device) for k, v in batch.items()}
            return engine.compute_logprobs(batch, temperature=temperature, micro_batch_size=micro_batch_size).cpu()

    def embed_images(self, pixel_values: list, image_grid_thw: list, vit_micro_batch_size,
                     pixel_values_videos: list = (), video_grid_thw: list = ()) -> list:
        """``reuse_image_embeds``: the actor's vision tower on this worker's share of the samples, their
        videos too (:func:`~posttrain.training.sample_embeds.embed_samples`; no collective)."""
        return embed_samples(self.policy.model, pixel_values, image_grid_thw, self.device, vit_micro_batch_size,
                             pixel_values_videos, video_grid_thw)

    def compute_pair_logps(self, batch: dict, average: bool, micro_batch_size):
        """DPO: the reference's sequence log-probs of this worker's share of the pairs."""
        if next(iter(batch.values())).shape[0] == 0:
            return torch.zeros(0), torch.zeros(0)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        chosen, rejected = self.policy.reference.compute_pair_logps(batch, average=average,
                                                                    micro_batch_size=micro_batch_size)
        return chosen.cpu(), rejected.cpu()

    def update(self, batch: dict, loss_fn, mini_batch_size: int,
               micro_batch_size: int | None = None) -> list[dict[str, float]]:
        """One optimizer step per ``mini_batch_size`` rows of ``batch`` (this rank's slices of the
        global mini-batches, already in the global order)."""
        return self.policy.actor.update(batch, loss_fn, mini_batch_size=mini_batch_size, epochs=1, shuffle=False,
                                        micro_batch_size=micro_batch_size)

    def release_gradients(self) -> None:
        """Free the actor's (and a colocated critic's) gradients after the update, as the loop does in
        one process (``OnPolicyTrainer.release_gradients``, through :class:`~posttrain.cluster.group.ActorRole`):
        the rollout in between never reads them. Megatron's engines keep theirs in their buffers."""
        release_gradients_of(self.policy.actor, getattr(getattr(self, "critic", None), "engine", None))

    def drop_sampling_weights(self) -> int:
        """Free the weights only this worker's rollout reads (packs, the bf16 sampling copy's) before the
        update, which changes them (``loops.sources.SyncSource``, through
        :class:`~posttrain.cluster.group.RolloutRole`); the number of tensors freed."""
        drop = getattr(self.policy.rollout, "drop_sampling_weights", None)  # None: Megatron's ranks without a rollout
        return drop() if drop is not None else 0

    def compute_values(self, batch: dict, micro_batch_size):
        rows, width = batch["response_mask"].shape
        if rows == 0:
            return torch.zeros(0, width)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        return self.critic.compute_values(batch, micro_batch_size=micro_batch_size).cpu()

    def score_rewards(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        """The reward model's scores of this worker's share of the rows (no collective)."""
        if not prompts:
            return []
        return self.reward_model.score_sequences(prompts, responses)

    def critic_update(self, batch: dict, loss_fn, mini_batch_size: int,
                      micro_batch_size: int | None = None) -> list[dict[str, float]]:
        """The critic's optimizer steps on this rank's slices of the global mini-batches (as :meth:`update`)."""
        return self.critic.update(batch, loss_fn, mini_batch_size=mini_batch_size, epochs=1, shuffle=False,
                                  micro_batch_size=micro_batch_size)

    def save(self, save_dir: str, iteration: int, sampler_state, trainer_state: dict, save_optim: bool,
             save_rng: bool, files: dict | None = None) -> str:
        """The Ray path's one checkpoint save: rank 0 writes the full model and optimizer state (DDP:
        its own whole replica; FSDP2: all ranks call this to gather the full state first, and the
        others return None), and ``files`` (the loop's objects by file name: partial rollout's dock)."""
        p = self.policy
        model, optimizer = p.model, p.actor.optimizer
        if self.fsdp:
            weights, optim_state = full_state(p.model, p.actor.optimizer, self.param_names,
                                              trainable_only=self.adapter_only and hasattr(p.model, "peft_config"))
            if self.rank != 0:
                return None
            copy = FullCopy(p.model, weights, optim_state)
            model, optimizer = copy.model, copy
        extra = {"critic": self.critic.part} if self.critic is not None and self.critic.save_dir is None else None
        with on_device(p.actor, getattr(self.critic, "engine", None)):  # an offloaded state is saved too
            path = save_checkpoint(save_dir, iteration, model, optimizer, p.actor.scheduler,
                                   tokenizer=p.processor or p.tokenizer,  # a VLM: its image processor too
                                   sampler_state=sampler_state, trainer_state=trainer_state,
                                   save_optim=save_optim, save_rng=save_rng, extra=extra, files=files,
                                   adapter_only=self.adapter_only)
        return str(path)

    def state_dict(self) -> dict:
        """The full model weights on CPU (for tests and checks; FSDP2: a collective)."""
        return {k: _full(v) for k, v in self.policy.model.state_dict().items()}

    def critic_save(self, iteration: int, trainer_state: dict) -> str | None:
        """The critic's own checkpoint (``critic_config.save``), written by rank 0 (DDP replicas)."""
        path = self.critic.save(iteration, tokenizer=self.policy.tokenizer, trainer_state=trainer_state)
        return str(path) if path is not None else None

    def critic_state_dict(self) -> dict:
        """The critic's full weights on CPU (for tests)."""
        return {k: _full(v) for k, v in self.critic.model.state_dict().items()}

    def parameter_bytes(self) -> dict[str, int]:
        """Bytes of this worker's own parameter storage (FSDP2: its shards; DDP: the whole replica),
        ``trainable`` and ``frozen`` (a LoRA model's base) apart; a tied weight once."""
        out = {"trainable": 0, "frozen": 0}
        for param in self.policy.model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            out["trainable" if param.requires_grad else "frozen"] += local.numel() * local.element_size()
        return out

    def grads(self, role: str = "actor") -> dict:
        """The full gradients of the last optimizer step (after the all-reduce and clipping) of the
        actor, or with ``role="critic"`` of the colocated critic, on CPU (FSDP2: a collective)."""
        model = self.critic.model if role == "critic" else self.policy.model
        return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}

    def allreduce_probe(self, numel: int, repeats: int) -> float:
        """Median milliseconds of one all-reduce of ``numel`` float32 over the group (all ranks call
        it together; benchmarks/cluster uses it to price DDP's gradient exchange)."""
        t = torch.ones(numel, device=self.device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
