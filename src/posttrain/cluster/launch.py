"""How a run goes to Ray: connecting, the runtime env, the placement group. (Whether it does is
the plan's :func:`posttrain.config.check.uses_ray`.)"""

from __future__ import annotations

import logging
import os

from posttrain.cluster.remote import ClusterError
from posttrain.config.options import ClusterOptions

log = logging.getLogger(__name__)


def connect(options: ClusterOptions, workers: int, extra_cpus: int = 0) -> bool:
    """``ray.init`` to ``rl_config.ray_address`` / RAY_ADDRESS, or a new local cluster; returns
    True when this call started Ray (so closing the run shuts it down again). An already
    initialised Ray (a test, or a user script) is used as it is. The workers get the plan's env
    vars (``runtime_env_path``, ``HCCL_BUFFSIZE``) and this process's ``PYTHONPATH`` (so they import
    the driver's modules, e.g. user verifiers). A new local cluster has ``extra_cpus`` more CPUs than the
    workers reserve (TransferQueue's actors, data_strategy: tq)."""
    import ray

    if ray.is_initialized():
        return False
    address = options.address or os.environ.get("RAY_ADDRESS")
    env = dict(options.env_vars)
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    kwargs = {"runtime_env": {"env_vars": env}, "include_dashboard": False,
              "log_to_driver": True, "logging_level": logging.WARNING}
    if address:
        log.info("connecting to the Ray cluster at %s", address)
        token_auth_if_available()
        ray.init(address=address, **kwargs)
    else:  # a local cluster with at least one CPU per worker (CPU workers are processes)
        cpus = max(os.cpu_count() or 1, workers * options.cpus_per_worker + extra_cpus)
        # Ray runs workers at nice 15 by default (to keep its own daemons responsive); here the
        # workers are the job, and at nice 15 they lose to every other process on a shared machine
        ray.init(num_cpus=cpus, _system_config={"worker_niceness": 0}, **kwargs)
    return True


def token_auth_if_available() -> None:
    """Send Ray's authentication token when one is at hand. ``ray start --head`` (Ray >= 2.5x) turns
    token authentication on when a token exists (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN_PATH`` or
    ``RAY_AUTH_TOKEN``), but ``ray.init(address=...)`` does not, so a driver joining such a cluster is
    refused ("Authentication token is missing"). With a token and ``RAY_AUTH_MODE`` unset, this sets
    ``RAY_AUTH_MODE=token``; a cluster without authentication accepts the token too. An explicit
    ``RAY_AUTH_MODE`` is kept."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path):
        log.info("joining the Ray cluster with token authentication (RAY_AUTH_MODE=token)")
        os.environ["RAY_AUTH_MODE"] = "token"


def bundle(use_gpu: bool, cpus_per_worker: int) -> dict[str, float]:
    """One placement-group bundle per actor worker: a GPU (plus a CPU), or CPUs for a CPU process."""
    return {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": float(cpus_per_worker)}


def placement_group(count: int, use_gpu: bool, cpus_per_worker: int, timeout_s: float,
                    what: str = "actor workers", key: str = "actor_resource"):
    """A PACK placement group with ``count`` bundles, ready, or a clear error after ``timeout_s``
    naming ``what`` it was for and the ``rl_config`` ``key`` of their count."""
    import ray
    from ray.util.placement_group import placement_group as make_pg
    from ray.util.placement_group import remove_placement_group

    bundles = [bundle(use_gpu, cpus_per_worker) for _ in range(count)]
    pg = make_pg(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise ClusterError(
            f"the Ray cluster cannot place {count} {what} ({bundles[0]} each) within {timeout_s:.0f} s; "
            f"it has {ray.cluster_resources()}. Lower rl_config.{key}.num_npus, add nodes, or "
            f"raise rl_config.ray_timeout_s.")
    return pg


def bundle_nodes(pg) -> list[str]:
    """The Ray node id of each bundle of the ready placement group ``pg``, in bundle order."""
    from ray.util.placement_group import placement_group_table

    where = placement_group_table(pg)["bundles_to_node_id"]
    return [where[index] for index in sorted(where)]


def node_label(node_id: str) -> str:
    """``node 1a2b3c4d (10.0.0.2)``: a node as the error messages name it (the id's first 8 hex
    digits, as ``ray status`` and ``ray list nodes`` show them, and its IP)."""
    import ray

    ip = next((n.get("NodeManagerAddress") for n in ray.nodes() if n["NodeID"] == node_id), None)
    return f"node {node_id[:8]}" + (f" ({ip})" if ip else "")


def queue_cpus(plan) -> int:
    """The CPUs TransferQueue's actors reserve (data_strategy: tq): one for the controller and one per
    storage unit (transferqueue declares its actors with ``num_cpus=1``); 0 without it."""
    return 1 + plan.queue_shards if plan.data_strategy == "tq" else 0
