"""``posttrain plan --target``: plan a config for hardware this machine is not.

A :class:`Target` names the kind of device (``cuda``, ``npu`` or ``cpu``), the memory of one device
(of one node for ``cpu``) and, optionally, the cluster's shape (``--nodes`` x ``--devices-per-node``).
The plan then runs the checks ``train`` would run there: the device type decides precision (bf16
on ``cuda`` and ``npu``: Ampere-or-newer GPUs and Ascend NPUs compute it natively; float32 on a
``cpu`` target, whose bf16 units are unknown) and which keys are CUDA-only (e.g.
``use_distributed_optimizer``), nothing is asked of this machine (its GPU, its memory, the ``vllm``
package, the files the config names), and the memory estimate is compared with the target's
device (:func:`check_target_memory`).

An ``npu`` target is the seed's hardware (MindSpeed-RL ran on Ascend NPUs). posttrain runs on CUDA
GPUs, so it plans an ``npu`` target as CUDA devices of the same memory: a capacity check (would the
seed's recipe fit those devices with posttrain's layout), not a promise that posttrain runs on NPUs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from posttrain.config.plan import Plan
    from posttrain.config.run import RunConfig
    from posttrain.config.validate import DeviceLayout

GIB = 1024**3
KINDS = {"cuda": "cuda", "npu": "cuda", "cpu": "cpu"}  # target kind -> the device type posttrain plans it as
UNITS = {"gib": 1024**3, "gb": 10**9, "mib": 1024**2, "mb": 10**6, "tib": 1024**4, "tb": 10**12}
FORMS = ("cuda:<size>, npu:<size> or cpu:<size> (the memory of one device, of one node for cpu), the size a "
         "number with a unit, GiB, GB, MiB, MB, TiB or TB: e.g. cuda:80GiB, npu:64GiB, cpu:24GiB")


@dataclass(frozen=True)
class Target:
    """The hardware ``posttrain plan --target`` plans for."""

    kind: str  # cuda | npu | cpu
    memory_bytes: int  # one device's memory (one node's for cpu)
    text: str  # as written after --target
    nodes: int | None = None  # --nodes
    devices_per_node: int | None = None  # --devices-per-node

    @property
    def device(self) -> str:
        """The device type posttrain plans it as: ``cuda`` for cuda and npu targets, ``cpu``."""
        return KINDS[self.kind]

    @property
    def bf16(self) -> bool:
        """Whether the target computes bf16 natively (the plan's precision follows the config there)."""
        return self.kind in ("cuda", "npu")

    def describe(self, num_devices: int) -> str:
        """One line for ``posttrain plan``: the target, its shape, and what an npu target means."""
        size = f"{self.memory_bytes / GIB:,.2f} GiB per {'node' if self.kind == 'cpu' else 'device'}"
        nodes = self.nodes or 1
        shape = (f"{nodes} node(s) x {num_devices // nodes} device(s)" if self.devices_per_node or self.nodes
                 else f"{num_devices} device(s), the config's count")
        line = f"target {self.text}: {size}, {shape}"
        if self.kind == "npu":
            line += ("; an npu target is a capacity check: it is the seed's hardware (Ascend NPUs), and posttrain, "
                     "which runs on CUDA, plans it as CUDA devices of that memory (bf16)")
        return line


def parse_target(text: str, nodes: int | None = None, devices_per_node: int | None = None) -> Target:
    """``cuda:80GiB`` -> Target; refuse anything else naming the accepted forms (:data:`FORMS`)."""
    kind, _, size = (text or "").strip().partition(":")
    kind = kind.lower()
    if kind not in KINDS:
        raise ConfigError(f"--target {text!r}: unknown device {kind!r}; write {FORMS}")
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", size)
    if match is None or match.group(2).lower() not in UNITS:
        if not size.strip():
            why = "no size"
        elif re.fullmatch(r"\s*\d+(?:\.\d+)?\s*", size):
            why = f"the size {size.strip()} has no unit"
        else:
            why = f"cannot read the size {size.strip()!r}"
        raise ConfigError(f"--target {text!r}: {why}; write {FORMS}")
    memory = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if memory <= 0:
        raise ConfigError(f"--target {text!r}: the size must be above 0; write {FORMS}")
    for flag, value in (("--nodes", nodes), ("--devices-per-node", devices_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}={value}: must be at least 1")
    return Target(kind=kind, memory_bytes=memory, text=text.strip(), nodes=nodes, devices_per_node=devices_per_node)


def check_device_count(cfg: "RunConfig", target: Target, layout: "DeviceLayout") -> None:
    """``--nodes`` x ``--devices-per-node`` must be the devices the config asks for."""
    count = layout.num_devices
    keys = f"rl_config.actor_resource.num_npus={cfg.rl.actor_resource.num_npus or 1}"
    nodes = target.nodes or 1
    if target.devices_per_node is not None:
        if nodes * target.devices_per_node != count:
            raise ConfigError(f"--nodes {nodes} x --devices-per-node {target.devices_per_node} = "
                              f"{nodes * target.devices_per_node} devices, but the config uses {count} ({keys}); "
                              f"give the cluster the config was written for, or change the config's resources")
    elif count % nodes:
        raise ConfigError(f"--nodes {nodes}: the config's {count} devices ({keys}) cannot be spread evenly over "
                          f"{nodes} nodes; give --devices-per-node too, or change the config's resources")


def check_device_setting(cfg: "RunConfig", target: Target) -> None:
    """``rl_config.device`` written as a device of another kind than the target's is a contradiction."""
    written = (cfg.rl.device or "auto").split(":")[0]
    if written != "auto" and written != target.device:
        raise ConfigError(f"rl_config.device={cfg.rl.device} but --target {target.text} plans for {target.device} "
                          f"devices; remove rl_config.device (auto) or plan for a {written} target")


def check_target_memory(cfg: "RunConfig", plan: "Plan", target: Target,
                        rollout_fits: Callable[["Plan"], None]) -> list[str]:
    """The memory estimate per worker process (one device each) against the target's device; a
    ``cpu`` target holds ``workers / nodes`` processes per node. Above it: a ConfigError (for a cpu
    target a warning up to twice the node's memory, as on this machine) unless
    ``rl_config.ignore_memory_estimate``, which makes it a warning. ``rollout_fits``
    (:func:`posttrain.config.memory.check_rollout_fits`) refuses a rollout copy larger than a device;
    both refusals come together."""
    messages: list[str] = []
    if not cfg.rl.ignore_memory_estimate:
        try:
            rollout_fits(plan)
        except ConfigError as err:
            messages.append(str(err))
    warnings: list[str] = []
    if plan.memory is not None:
        per_process = plan.memory.total
        if target.kind == "cpu":
            per_node = math.ceil(plan.workers / (target.nodes or 1))
            need, where = per_process * per_node, f"{per_node} process(es) per node x {per_process / GIB:,.2f} GiB"
        else:
            need, where = per_process, "one worker process per device"
        if need > target.memory_bytes:
            what = (f"the plan's memory estimate, {need / GIB:,.2f} GiB per "
                    f"{'node' if target.kind == 'cpu' else 'device'} ({where}), is above the target's "
                    f"{target.memory_bytes / GIB:,.2f} GiB (--target {target.text})")
            fix = ("lower actor_config.micro_batch_size, generate_config.max_num_seqs or "
                   "generate_config.sampling_config.max_tokens, or split the model over more devices "
                   "(posttrain plan prints the estimate's parts)")
            if cfg.rl.ignore_memory_estimate or (target.kind == "cpu" and need <= 2 * target.memory_bytes):
                warnings.append(f"{what}: the run may run out of memory there. To fit, {fix}")
            else:
                messages.append(f"{what}. To fit, {fix}; or set rl_config.ignore_memory_estimate: true to plan "
                                f"anyway")
    if messages:
        raise ConfigError("\n".join(messages))
    return warnings
