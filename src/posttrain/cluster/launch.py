"""How a run goes to Ray: connecting, the runtime env, the placement group. (Whether it does is
the plan's :func:`posttrain.config.check.uses_ray`.)"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from posttrain.config.run import RunConfig
from posttrain.errors import ConfigError
from posttrain.paths import PROJECT_ROOT

log = logging.getLogger(__name__)


def runtime_env_vars(cfg: RunConfig) -> dict[str, str]:
    """The ``env_vars`` of ``rl_config.runtime_env_path`` (the seed's configs/envs/runtime_env.yaml,
    relative paths from the current directory, then the repository), plus what the driver adds:
    ``HCCL_BUFFSIZE`` (the seed's) and ``PYTHONPATH`` (so workers import the driver's modules,
    e.g. user verifiers)."""
    import yaml

    env: dict[str, str] = {}
    path = Path(cfg.rl.runtime_env_path)
    candidates = [path] if path.is_absolute() else [path, PROJECT_ROOT / path]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        log.warning("rl_config.runtime_env_path %s not found; the workers get no extra env_vars", path)
    else:
        data = yaml.safe_load(found.read_text()) or {}
        if not isinstance(data, dict) or not isinstance(data.get("env_vars", {}), dict):
            raise ConfigError(f"{found}: expected a mapping with an 'env_vars' mapping (name: value)")
        env.update({str(k): str(v) for k, v in (data.get("env_vars") or {}).items()})
    env["HCCL_BUFFSIZE"] = str(cfg.rl.hccl_buffersize)
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def connect(cfg: RunConfig) -> bool:
    """``ray.init`` to ``rl_config.ray_address`` / RAY_ADDRESS, or a new local cluster; returns
    True when this call started Ray (so closing the run shuts it down again). An already
    initialised Ray (a test, or a user script) is used as it is."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.rl.ray_address or os.environ.get("RAY_ADDRESS")
    kwargs = {"runtime_env": {"env_vars": runtime_env_vars(cfg)}, "include_dashboard": False,
              "log_to_driver": True, "logging_level": logging.WARNING}
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, **kwargs)
    else:  # a local cluster with at least one CPU per worker (CPU workers are processes)
        cpus = max(os.cpu_count() or 1, (cfg.rl.actor_resource.num_npus or 1) * cfg.rl.ray_num_cpus_per_worker)
        # Ray runs workers at nice 15 by default (to keep its own daemons responsive); here the
        # workers are the job, and at nice 15 they lose to every other process on a shared machine
        ray.init(num_cpus=cpus, _system_config={"worker_niceness": 0}, **kwargs)
    return True


def bundle(use_gpu: bool, cpus_per_worker: int) -> dict[str, float]:
    """One placement-group bundle per actor worker: a GPU (plus a CPU), or CPUs for a CPU process."""
    return {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": float(cpus_per_worker)}


def placement_group(count: int, use_gpu: bool, cpus_per_worker: int, timeout_s: float):
    """A PACK placement group with ``count`` bundles, ready, or a clear error after ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group as make_pg
    from ray.util.placement_group import remove_placement_group

    from posttrain.cluster.remote import ClusterError

    bundles = [bundle(use_gpu, cpus_per_worker) for _ in range(count)]
    pg = make_pg(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise ClusterError(
            f"the Ray cluster cannot place {count} actor workers ({bundles[0]} each) within {timeout_s:.0f} s; "
            f"it has {ray.cluster_resources()}. Lower rl_config.actor_resource.num_npus, add nodes, or "
            f"raise rl_config.ray_timeout_s.")
    return pg
