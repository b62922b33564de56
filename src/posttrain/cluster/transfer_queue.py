"""``rl_config.data_strategy: tq``: the experience table's cells in TransferQueue (the ``transferqueue``
package, ``pip install 'posttrain[tq]'``) instead of the driver's memory.

:class:`TransferQueueStore` starts TransferQueue once per run: its controller and its
``transfer_queue_data_shard_num`` storage units are Ray actors (``SimpleStorage``, ZMQ in-memory
storage), on the run's Ray cluster or, for a run in one process, on a local Ray that it starts and
shuts down. :class:`TransferQueueDock` is a :class:`~posttrain.transfer_dock.TransferDock` whose cells
live in that storage: every ``put`` writes the rows through TransferQueue's key-value layer (one key
per row, one field per column, variable-length rows as jagged nested tensors) and every ``get`` reads
them back from it. Readiness, consumption and the row choice (in order, or the dock's seeded random
draw, whole groups with ``get_n_samples``) stay the dock's, so a run reads the same rows, in the same
order, as with the TransferDock, and its metrics are the same (tests/cluster/test_transfer_queue.py).

Each dock is one TransferQueue partition; :meth:`TransferDock.clear` and the dock's end free its
rows in the storage units. TransferQueue picks the ZMQ ports itself (no port setting, hence
``transfer_queue_data_shard_port_base`` is refused), and a second run on the same Ray cluster joins
the running controller (its shard count is the first run's).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch

from posttrain.cluster.remote import ClusterError
from posttrain.extras import require
from posttrain.transfer_dock import TransferDock

log = logging.getLogger(__name__)
_partitions = itertools.count()
CPU_WAIT_S = 20.0  # how long the start waits for the CPUs of TransferQueue's actors to be free


def _nested(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows of one column (1-D, any lengths, one dtype) as one jagged nested tensor."""
    return torch.nested.nested_tensor([r.detach().cpu().contiguous() for r in rows], layout=torch.jagged)


def _rows(values: torch.Tensor) -> list[torch.Tensor]:
    """A column read back (nested, or dense when TransferQueue stacked equal rows) as 1-D rows."""
    return [r.reshape(-1).clone() for r in values.unbind(0)]


def _drop(partition: str, keys: set[str]) -> None:
    """Free a dock's rows in the storage units (the dock's finaliser; TransferQueue may be closed)."""
    import transfer_queue as tq

    if keys and tq.interface._TQ_CLIENT is not None:
        try:
            tq.kv_clear(keys=sorted(keys), partition_id=partition)
        except Exception as exc:  # the run is ending; the storage actors go with it
            log.debug("could not free TransferQueue partition %s: %s", partition, exc)


def _check_cpus(needed: int) -> None:
    """TransferQueue's actors wait forever for CPUs that the Ray cluster does not have: refuse instead
    (after ``CPU_WAIT_S``: the CPUs of actors just killed, e.g. a previous run's, come back late)."""
    import ray

    deadline = time.monotonic() + CPU_WAIT_S
    while (free := ray.available_resources().get("CPU", 0)) < needed and time.monotonic() < deadline:
        time.sleep(0.5)
    if free < needed:
        raise ClusterError(f"rl_config.data_strategy: tq needs {needed} free CPUs on the Ray cluster (TransferQueue's "
                           f"controller and each of transfer_queue_data_shard_num storage units reserve one); it has "
                           f"{free:g} free. Lower transfer_queue_data_shard_num, or give the cluster more CPUs")


class TransferQueueDock(TransferDock):
    """A TransferDock whose cells are stored in TransferQueue (the module docstring says how)."""

    def __init__(self, max_len: int, columns: Iterable[str], consumers: Iterable[str], **kw) -> None:
        self.partition = f"posttrain-{os.getpid()}-{next(_partitions)}"
        self._stored: set[str] = set()  # the keys (rows) that hold cells in TransferQueue
        self._finalizer = weakref.finalize(self, _drop, self.partition, self._stored)
        super().__init__(max_len, columns, consumers, **kw)

    def _clear_cells(self, indexes: list[int] | None) -> None:
        import transfer_queue as tq

        keys = set(self._stored) if indexes is None else {str(i) for i in indexes} & self._stored
        if keys:
            tq.kv_clear(keys=sorted(keys), partition_id=self.partition)
            self._stored -= keys

    def _write_cells(self, indexes: list[int], columns: Mapping[str, list[torch.Tensor]]) -> None:
        import transfer_queue as tq
        from tensordict import TensorDict

        if not columns:
            return
        keys = [str(i) for i in indexes]
        fields = TensorDict({column: _nested(rows) for column, rows in columns.items()}, batch_size=len(keys))
        tq.kv_batch_put(keys=keys, partition_id=self.partition, fields=fields)
        self._stored.update(keys)

    def _read_cells(self, columns: Sequence[str], indexes: list[int]) -> dict[str, list[torch.Tensor]]:
        import transfer_queue as tq

        if not indexes or not columns:
            return {c: [] for c in columns}
        data = tq.kv_batch_get(keys=[str(i) for i in indexes], partition_id=self.partition,
                               select_fields=list(columns))
        return {c: _rows(data[c]) for c in columns}

    def _all_cells(self) -> dict[str, list[torch.Tensor | None]]:
        cells: dict[str, list[torch.Tensor | None]] = {}
        for c in self.columns:
            rows = [int(i) for i in self._ready[c].nonzero()[0]]
            read = dict(zip(rows, self._read_cells([c], rows)[c]))
            cells[c] = [read.get(i) for i in range(self.max_len)]
        return cells


class TransferQueueStore:
    """TransferQueue for one run: :meth:`start` connects (starting a local Ray when none is up) and
    starts the controller and storage units; :meth:`new_dock` makes a dock in it; :meth:`close` stops
    what :meth:`start` started."""

    def __init__(self, owns_ray: bool) -> None:
        self.owns_ray = owns_ray
        self.closed = False

    @classmethod
    def start(cls, plan) -> TransferQueueStore:
        require("transfer_queue", "rl_config.data_strategy: tq (TransferQueue)")
        import transfer_queue as tq

        from posttrain.cluster import launch

        owns_ray = launch.connect(plan.cluster, 0, extra_cpus=launch.queue_cpus(plan))
        _check_cpus(launch.queue_cpus(plan))
        tq.init({"backend": {"storage_backend": "SimpleStorage",
                             "SimpleStorage": {"num_data_storage_units": plan.queue_shards}}})
        log.info("TransferQueue started: %d storage unit(s)", plan.queue_shards)
        return cls(owns_ray)

    def new_dock(self, max_len: int, columns: Iterable[str], consumers: Iterable[str], **kw) -> TransferQueueDock:
        return TransferQueueDock(max_len, columns, consumers, **kw)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        import ray
        import transfer_queue as tq

        tq.close()
        if self.owns_ray:
            ray.shutdown()
