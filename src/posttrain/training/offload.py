"""Memory for colocation: what a policy whose rollout shares its device keeps off that device
between its uses.

* :class:`StateOffload`, the seed's ``generate_config.offload_train_optimizer`` and
  ``offload_train_grad``: after each update (:meth:`posttrain.training.engine.TrainEngine.update`)
  the optimizer's state (AdamW's two moments) goes to host memory and the gradients are freed;
  the next update brings the state back before its first step, so rollout, log-probs and rewards
  run with that memory free for the KV cache. Gradients are freed, not copied: every update
  starts by zeroing them (as the seed's offloader does, ``copy_data=False``). On a CPU the host is
  the device: the plan leaves the state where it is (the config lists ``offload_train_optimizer``
  as having no effect there), while freeing the gradients still lowers the process's memory. (An
  synchronous on-policy run of the HF backend frees the gradients after each update without the
  key, in process and in Ray workers, :meth:`posttrain.loops.onpolicy.OnPolicyTrainer.release_gradients`;
  the key adds ``malloc_trim`` on a CPU, frees them under a pipelined rollout and frees Megatron's buffers.)
* :class:`OffloadedReference`, ``rl_config.offload_reference``: the frozen reference's weights off
  the device between its log-prob passes.
* :class:`WeightOffload` and :class:`WeightsOffDuringRollout`, the seed's
  ``generate_config.offload_train_param``: while a rollout engine samples from weights of its own
  (vLLM's copy, the native engine's bf16 sampling copy) the actor's weights (a LoRA model's frozen
  base too; under FSDP2 this rank's shards) wait in pinned host memory, and come back for the
  log-probs and the update. Where the engine samples from the actor's weights themselves (the
  native engine in the weights' dtype, a LoRA adapter merged in place, FSDP2's gathered
  parameters) they cannot leave: refused (the config check names the key; :func:`weights_off_during_rollout`
  is the backstop). On a CPU host and device are the same memory: listed as having no effect.

The Megatron-Core backend's counterpart is :class:`posttrain.training.megatron.engine.MegatronOffload`.
"""

from __future__ import annotations

import contextlib
import time
import ctypes
import ctypes.util
from pathlib import Path

import torch

from posttrain.errors import ConfigError


@contextlib.contextmanager
def on_device(*engines):
    """The engines' offloaded optimizer state back on the device for the block (a checkpoint save
    reads it), and off again after it; engines without an offload are left alone."""
    offloads = [e.offload for e in engines if getattr(e, "offload", None) is not None]
    for offload in offloads:
        offload.to_device()
    try:
        yield
    finally:
        for offload in offloads:
            offload.to_host()


def return_freed_memory() -> None:
    """Ask glibc to hand freed heap memory back to the system (``malloc_trim``), so that freed
    gradients or a dropped reference lower the process's RSS on a CPU; a no-op elsewhere."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        libc = None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class StateOffload:
    """Sends ``optimizer``'s state to the host (``to_host``) and brings it back (``to_device``).

    As the seed's offloader does, every state tensor keeps its identity: its storage's bytes are
    copied to host memory (pinned on a GPU) and the device storage is resized to 0; ``to_device``
    resizes the storage back and copies the bytes in. The same code serves plain tensors (one
    process, DDP) and FSDP2's DTensor state (the storage of this rank's local shard).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, optimizer_state: bool, grads: bool):
        self.optimizer, self.optimizer_state, self.grads = optimizer, optimizer_state, grads
        self.held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (device storage, its bytes on the host)

    def params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def storages(self) -> list[torch.UntypedStorage]:
        """The storages of the optimizer's state tensors (AdamW's moments, not the scalar ``step``),
        each once."""
        out, seen = [], set()
        for p in self.params():
            for value in self.optimizer.state.get(p, {}).values():
                local = value.to_local() if hasattr(value, "to_local") else value  # FSDP2: this rank's shard
                if not torch.is_tensor(local) or local.dim() == 0:
                    continue
                storage = local.untyped_storage()
                if storage.nbytes() > 0 and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    out.append(storage)
        return out

    def to_host(self) -> None:
        if self.grads:
            for p in self.params():
                p.grad = None
            if any(p.device.type == "cpu" for p in self.params()):
                return_freed_memory()
        if not self.optimizer_state or self.held:
            return
        self.held = park(self.storages())

    def to_device(self) -> None:
        unpark(self.held)
        self.held = []

    def device_bytes(self) -> int:
        """Bytes the optimizer's state holds in its own storages (0 while it is on the host)."""
        return sum(storage.nbytes() for storage in self._state_storages())

    def host_bytes(self) -> int:
        """Bytes of optimizer state waiting in host memory."""
        return sum(host.numel() for _, host in self.held)

    def _state_storages(self):
        return [storage for storage, _ in self.held] or self.storages()


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def park(storages: list[torch.UntypedStorage]) -> list[tuple[torch.UntypedStorage, torch.Tensor]]:
    """Each storage's bytes copied to host memory (pinned for a GPU's), then the storage resized to
    0: the tensors over it keep their identity (and version counters) but hold no memory. Returns
    (storage, its bytes on the host) pairs for :func:`unpark`."""
    held = []
    for storage in storages:
        pin = storage.device.type == "cuda"
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
        host.copy_(_bytes_of(storage), non_blocking=pin)
        held.append((storage, host))
    if any(storage.device.type == "cuda" for storage, _ in held):
        torch.cuda.synchronize()  # the copies are done before the device storage goes
    for storage, _ in held:
        storage.resize_(0)
    return held


def unpark(held: list[tuple[torch.UntypedStorage, torch.Tensor]]) -> None:
    """Every parked storage back at its size with its bytes (copied from pinned memory asynchronously,
    ordered on the device's stream before any later kernel that reads it)."""
    for storage, host in held:
        storage.resize_(host.numel())
        _bytes_of(storage).copy_(host, non_blocking=host.is_pinned())


class WeightOffload:
    """``generate_config.offload_train_param``: the storages of ``model``'s parameters (this rank's
    local shards under FSDP2: read at each call, so a model sharded after this is built is seen as
    sharded) to the host (:meth:`to_host`) and back (:meth:`to_device`), as :class:`StateOffload`
    moves the optimizer state; a storage shared by tied weights moves once. Buffers (rotary tables)
    stay: they are small."""

    def __init__(self, model):
        self.model = model
        self.held: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    def storages(self) -> list[torch.UntypedStorage]:
        out, seen = [], set()
        for param in self.model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param  # FSDP2: this rank's shard
            storage = local.untyped_storage()
            if storage.nbytes() > 0 and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out.append(storage)
        return out

    def to_host(self) -> None:
        if not self.held:
            self.held = park(self.storages())

    def to_device(self) -> None:
        unpark(self.held)
        self.held = []

    def device_bytes(self) -> int:
        """Bytes the parameters hold in their own storages now (0 while on the host)."""
        return sum(storage.nbytes() for storage in ([s for s, _ in self.held] or self.storages()))

    def host_bytes(self) -> int:
        return sum(host.numel() for _, host in self.held)


def samples_from_own_weights(engine) -> bool:
    """Whether the rollout ``engine`` samples from weights of its own: vLLM's copy
    (``holds_weights``), the native engine's sampling copy (``samples_from_copy``)."""
    return bool(getattr(engine, "holds_weights", False) or getattr(engine, "samples_from_copy", False))


def weights_off_during_rollout(engine, model) -> WeightsOffDuringRollout:
    """``engine`` with ``model``'s weights on the host while it samples; refuses an engine that
    samples from those weights themselves (naming the key)."""
    if not samples_from_own_weights(engine):
        raise ConfigError(_READS_WEIGHTS.format(engine=type(getattr(engine, "engine", engine)).__name__))
    return WeightsOffDuringRollout(engine, WeightOffload(model))


_READS_WEIGHTS = ("generate_config.offload_train_param=true: the rollout engine ({engine}) samples from the training "
                  "weights themselves (the native engine does so in the weights' own dtype, with a LoRA adapter merged "
                  "in place, or on FSDP2's gathered parameters), so they cannot leave the GPU during rollout; sample "
                  "from a copy (generate_config.dtype: bfloat16 on fp32 weights, or rl_config.rollout_engine: vllm) "
                  "or remove the key")


class WeightsOffDuringRollout:
    """A rollout engine (:class:`~posttrain.rollout.base.RolloutEngine`) whose ``generate`` runs with
    the actor's weights in host memory (:class:`WeightOffload`): the native engine's sampling copy
    is refreshed first (``prepare_sampling``), then the weights leave, and they are back before
    ``generate`` returns (or raises). Weight syncs (vLLM), metrics and the engine's other attributes
    are the engine's: they run with the weights in place."""

    def __init__(self, engine, offload: WeightOffload):
        self.engine, self.offload = engine, offload

    def generate(self, *args, **kwargs):
        if not samples_from_own_weights(self.engine):  # checked at build; the weights' layout may change
            raise ConfigError(_READS_WEIGHTS.format(engine=type(getattr(self.engine, "engine", self.engine)).__name__))
        prepare = getattr(self.engine, "prepare_sampling", None)
        if prepare is not None:
            prepare()
        self.offload.to_host()
        try:
            return self.engine.generate(*args, **kwargs)
        finally:
            self.offload.to_device()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


class OffloadedReference:
    """The frozen reference off the device between its uses (``rl_config.offload_reference``), as
    the seed's integrated worker keeps it: an engine (:class:`~posttrain.training.engine.TrainEngine`
    or the Megatron one) whose weights are brought in for each log-prob call and sent away after
    it; a :class:`~posttrain.training.base.ReferenceEngine`.

    * GPU: the weights wait in pinned host memory and are copied in for each call.
    * CPU: the weights are written once to ``spill_dir/reference.pt``; between calls they are
      dropped, and each call maps the file back (``torch.load(mmap=True)``), so the process holds
      no private copy of them: the page cache holds the file, which the kernel can reclaim.

    Each move is a span ``(name, start, end)`` in :attr:`moves` (``timing/ref_onload``,
    ``timing/ref_offload``, the seed's keys), which the loop takes with :meth:`pop_moves` and sums.
    """

    def __init__(self, engine, spill_dir):
        self.engine = engine
        self.moves: list[tuple[str, float, float]] = []
        model = engine.model
        self.device = next(model.parameters()).device
        self.names = [name for name, _ in model.named_parameters()]  # tied weights: one entry
        self.path = None
        if self.device.type == "cpu":
            self.path = Path(spill_dir) / "reference.pt"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".pt.tmp")
            torch.save({n: p.detach() for n, p in model.named_parameters()}, tmp)
            tmp.replace(self.path)
        self._offload()

    @property
    def dp_group(self):
        return self.engine.dp_group

    @dp_group.setter
    def dp_group(self, group) -> None:
        self.engine.dp_group = group

    def _params(self):
        return dict(self.engine.model.named_parameters())

    def _offload(self) -> None:
        pin = torch.cuda.is_available() and self.device.type == "cuda"
        for param in self._params().values():
            if self.path is not None:
                param.data = torch.empty(0, dtype=param.dtype)  # the storage goes; the file keeps the values
            else:
                host = torch.empty(param.shape, dtype=param.dtype, pin_memory=pin)
                host.copy_(param.data)
                param.data = host
        if self.path is not None:
            return_freed_memory()

    def _onload(self) -> None:
        params = self._params()
        if self.path is not None:
            mapped = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
            for name in self.names:
                params[name].data = mapped[name]
        else:
            for param in params.values():
                param.data = param.data.to(self.device, non_blocking=True)

    @contextlib.contextmanager
    def _on_device(self):
        start = time.time()
        self._onload()
        self.moves.append(("timing/ref_onload", start, time.time()))
        try:
            yield
        finally:
            start = time.time()
            self._offload()
            self.moves.append(("timing/ref_offload", start, time.time()))

    def pop_moves(self) -> list[tuple[str, float, float]]:
        """The moves since the last call, as ``(key, start, end)`` wall-clock spans."""
        moves, self.moves = self.moves, []
        return moves

    def compute_logprobs(self, batch, *, temperature=1.0, micro_batch_size=None):
        with self._on_device():
            return self.engine.compute_logprobs(batch, temperature=temperature, micro_batch_size=micro_batch_size)

    def compute_pair_logps(self, batch, *, average=False, micro_batch_size=None):
        with self._on_device():
            return self.engine.compute_pair_logps(batch, average=average, micro_batch_size=micro_batch_size)
