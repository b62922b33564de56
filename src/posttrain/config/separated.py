"""The seed's separated roles (``rl_config.use_integrated_worker: false``) and posttrain's rollout worker.

``use_integrated_worker: false`` with ``reference_resource``, ``reward_resource`` and/or
``critic_resource`` puts the frozen reference, ``reward_config``'s reward model and PPO's critic
in Ray worker groups of their own, one placement group each, of ``num_npus`` workers
(:mod:`posttrain.cluster.role_groups`); a role whose resource is not given stays colocated with
the actor. A critic of its own writes checkpoints of its own (``critic_config.save``, a row of the
compatibility table). ``ref_config`` configures the separated
reference: its own ``load`` (the reference's weights) and ``micro_batch_size`` (rows per forward);
any other key it writes must repeat the actor's value (the reference is a frozen copy of the
actor's architecture). ``blocking: false`` starts the independent passes of an iteration together
(the reference's and the actor's log-probs, PPO's critic values) and waits for all of them.

posttrain's own placement, the rollout in a Ray worker process of its own beside the trainer
(:mod:`posttrain.cluster.rollout_worker`), is ``rl_config.separate_rollout_worker: true``. Its old
spelling, ``use_integrated_worker: false`` without any role resource, still means it for one
release, with a deprecation warning (:func:`check_separated`).

Partial rollout and ``async_staleness`` run with separated roles: the roles' passes read the
TransferDock for whatever samples the rollout finished, of any round or policy version. Which
combinations are refused (the megatron backend, the offline stages, the separate rollout worker, a
critic of its own without ``critic_config.save``, ``blocking: false`` in integrated mode, ...) is in
the compatibility table (:mod:`posttrain.config.compat`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.config.fields import Status, field_rule, fmt_value
from posttrain.config.loader import normalise_keys
from posttrain.config.megatron import MegatronConfig
from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError

# the roles that may get a worker group of their own, and the rl_config key of each one's devices
ROLE_RESOURCES = {"reference": "reference_resource", "reward": "reward_resource", "critic": "critic_resource"}
# the ref_config keys a separated reference reads
REF_READS = ("load", "micro_batch_size")
DEPRECATED_ROLLOUT_WORKER = (
    "rl_config.use_integrated_worker: false without reference_resource, reward_resource or critic_resource is "
    "posttrain's old spelling of rl_config.separate_rollout_worker: true (the rollout in a Ray worker process of its "
    "own); it still runs that way in this release, but from the next one use_integrated_worker: false means only the "
    "seed's separated roles. Write rl_config.separate_rollout_worker: true and remove use_integrated_worker")


@dataclass(frozen=True)
class SeparatedRoles:
    """The roles in worker groups of their own (``Plan.separated``)."""

    devices: dict[str, int] = field(default_factory=dict)  # role -> workers of its group (ROLE_RESOURCES' order)
    blocking: bool = True  # rl_config.blocking
    reference_micro_batch_size: int | None = None  # ref_config.micro_batch_size (None: the actor's)

    def __bool__(self) -> bool:
        return bool(self.devices)


def role_devices(cfg: RunConfig) -> dict[str, int]:
    """The roles ``cfg`` puts in groups of their own, with their device counts ({} in integrated mode)."""
    rl = cfg.rl
    if rl.use_integrated_worker:
        return {}
    out = {}
    for role, key in ROLE_RESOURCES.items():
        resource = getattr(rl, key)
        if resource is not None:
            out[role] = max(1, int(resource.num_npus or 1))
    return out


def legacy_rollout_worker(cfg: RunConfig) -> bool:
    """``use_integrated_worker: false`` with no role resource: the old spelling of the rollout worker."""
    return not cfg.rl.use_integrated_worker and not role_devices(cfg)


def rollout_worker(cfg: RunConfig) -> bool:
    """Whether the rollout runs in a Ray worker process of its own (``separate_rollout_worker``)."""
    return bool(cfg.rl.separate_rollout_worker) or legacy_rollout_worker(cfg)


def ref_config_keys(cfg: RunConfig) -> dict:
    """The keys ``ref_config`` itself writes (not those merged in from ``megatron_training``)."""
    section = cfg.raw.get("ref_config")
    return normalise_keys(section) if isinstance(section, dict) else {}


def check_separated(cfg: RunConfig, uses_reference: bool = True, uses_critic: bool = False) -> list[str]:
    """Raise :class:`ConfigError` for a reference or critic group without the role (``uses_*``: the
    stage has it), a critic group that cannot share a mini-batch equally, or a ``ref_config`` key a
    separated reference cannot honour; return the start-up warnings (the deprecated spelling of the
    rollout worker)."""
    groups = role_devices(cfg)
    if "reference" in groups:
        if not uses_reference:
            raise ConfigError(f"rl_config.reference_resource={fmt_value(cfg.rl.reference_resource)}: this run has no "
                              f"reference model (no KL term: init_kl_coef 0, or a stage without one), so there is "
                              f"nothing to place; remove the key")
        _check_ref_keys(cfg)
    if "critic" in groups:
        _check_critic_group(cfg, groups["critic"], uses_critic)
    return [DEPRECATED_ROLLOUT_WORKER] if legacy_rollout_worker(cfg) else []


def _check_critic_group(cfg: RunConfig, workers: int, uses_critic: bool) -> None:
    rl = cfg.rl
    if not uses_critic:
        raise ConfigError(f"rl_config.critic_resource={fmt_value(rl.critic_resource)}: this stage has no critic "
                          f"(PPO has one), so there is nothing to place; remove the key")
    rows = rl.mini_batch_size * rl.n_samples_per_prompt
    if rows % workers:
        raise ConfigError(f"rl_config.mini_batch_size x n_samples_per_prompt = {rows} rows cannot be shared equally "
                          f"by {workers} critic workers (rl_config.critic_resource.num_npus); make it a multiple of "
                          f"the worker count")


def _check_ref_keys(cfg: RunConfig) -> None:
    for name, value in ref_config_keys(cfg).items():
        if name in REF_READS or name not in MegatronConfig.model_fields:
            continue  # an unknown key is refused when the section loads
        rule = field_rule(MegatronConfig, name)
        mine, actor = getattr(cfg.ref, name), getattr(cfg.actor, name)
        if rule.status is Status.HONOURED and mine == actor:
            continue  # the actor's value: the reference is a frozen copy of the actor's architecture
        raise ConfigError(f"ref_config.{name}={fmt_value(value)}: the separated reference reads only ref_config.load "
                          f"(its weights) and ref_config.micro_batch_size (rows per forward); it is a frozen copy of "
                          f"the actor's architecture and trains nothing. Remove the key"
                          + (f" or give it the actor's value ({fmt_value(actor)})"
                             if rule.status is Status.HONOURED else ""))


def separated_options(cfg: RunConfig) -> SeparatedRoles:
    """The separated roles of a checked config."""
    own = ref_config_keys(cfg)
    micro = own.get("micro_batch_size")
    return SeparatedRoles(devices=role_devices(cfg), blocking=bool(cfg.rl.blocking),
                          reference_micro_batch_size=int(micro) if micro else None)


def reference_load(cfg: RunConfig) -> str | None:
    """``ref_config.load`` of a separated reference (None: a copy of the actor's initial weights)."""
    if "reference" not in role_devices(cfg):
        return None
    return str(ref_config_keys(cfg).get("load") or "") or None
