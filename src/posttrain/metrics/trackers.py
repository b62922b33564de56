"""Experiment trackers users already run, beside TensorBoard and wandb (:mod:`posttrain.metrics.sinks`):

* **trackio** (``rl_config.use_trackio``): local-first; a project (``trackio_project``, default
  ``posttrain``) of runs in trackio's own store (``$TRACKIO_DIR``, default
  ``~/.cache/huggingface/trackio``), browsed with ``trackio show``. Nothing leaves the machine.
* **MLflow** (``rl_config.use_mlflow``): an experiment (``mlflow_experiment``, default ``posttrain``)
  in ``mlflow_tracking_uri`` (default a local file store, ``file:<run dir>/mlruns``: MLflow 3 keeps
  that store in maintenance mode and asks for ``MLFLOW_ALLOW_FILE_STORE=true``, which this sink sets
  for a ``file:`` URI). The run's config is logged as its parameters.

* **SwanLab** (the seed's ``use_swanlab``, ``swanlab_mode``, ``swanlab_project``,
  ``swanlab_exp_name``, ``swanlab_save_dir``): ``local`` (the default) writes files only, under
  ``swanlab_save_dir`` (default ``<run dir>/swanlab``); ``cloud`` needs ``SWANLAB_API_KEY``.

All are optional (``pip install 'posttrain[trackers]'``); the config check refuses a tracker whose
package is missing, naming the extra. Each logs every iteration's metrics at ``step=iteration``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_MLFLOW_NAME = re.compile(r"[^0-9A-Za-z_\-. /]")  # the characters MLflow allows in a metric or parameter name


class _RunSink:
    """A tracker whose run object logs ``(metrics, step=)`` and ends with ``finish()``."""

    run = None

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=iteration)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class TrackioSink(_RunSink):
    """One trackio run (``trackio.init``/``log``/``finish``)."""

    def __init__(self, project: str, run_name: str, config: Mapping[str, Any] | None = None) -> None:
        import trackio

        self.run = trackio.init(project=project, name=run_name, config=dict(config or {}), embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)


def mlflow_name(key: str) -> str:
    return _MLFLOW_NAME.sub("_", key)


class MLflowSink:
    """One MLflow run through ``MlflowClient`` (no global active run: several runs in one process
    do not mix)."""

    def __init__(self, tracking_uri: str, experiment: str, run_name: str,
                 config: Mapping[str, Any] | None = None) -> None:
        if tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            Path(tracking_uri[len("file:"):]).mkdir(parents=True, exist_ok=True)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [Param(mlflow_name(k), str(v)[:6000]) for k, v in _flat(config or {}).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_name(k), float(v), now, iteration) for k, v in metrics.items()
                 if isinstance(v, (int, float))]
        for start in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[start:start + 1000])

    def close(self) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self.run_id = None


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


class SwanlabSink(_RunSink):
    """One SwanLab experiment (the seed's ``use_swanlab`` keys): ``local`` mode writes the run's files
    under ``save_dir`` and needs no network or account (``swanlab watch <save_dir>`` shows them);
    ``cloud`` logs to SwanLab's service with the user's ``SWANLAB_API_KEY``."""

    def __init__(self, mode: str, project: str, exp_name: str, save_dir: str | Path,
                 config: Mapping[str, Any] | None = None) -> None:
        import swanlab

        Path(save_dir).mkdir(parents=True, exist_ok=True)
        self.run = swanlab.init(mode="online" if mode == "cloud" else "local", project=project,
                                experiment_name=exp_name, log_dir=str(save_dir), config=dict(config or {}))
