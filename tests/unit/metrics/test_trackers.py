"""trackio, MLflow and SwanLab (posttrain.metrics.trackers), offline: a run's metrics read back from each
tracker's own store equal what metrics.jsonl holds; a missing package is refused naming its extra."""

from __future__ import annotations

import json

import pytest

from posttrain.metrics.sinks import MetricsLogger

ROWS = {1: {"grpo/score/mean": 0.25, "actor/pg_loss": -0.5}, 2: {"grpo/score/mean": 0.75, "actor/pg_loss": 0.125}}


def log_run(run_dir, **trackers):
    with MetricsLogger(run_dir, console=False, config={"rl_config": {"n_samples_per_prompt": 8}}, **trackers) as logger:
        for iteration, metrics in ROWS.items():
            logger.log(iteration, metrics)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_trackio_holds_every_iteration_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    pytest.importorskip("trackio", reason="pip install 'posttrain[trackers]'")
    import trackio.sqlite_storage as storage

    monkeypatch.setattr(storage, "TRACKIO_DIR", tmp_path / "trackio", raising=False)  # read once, at import
    rows = log_run(tmp_path / "run_a", trackio_project="pt_test")
    logged = storage.SQLiteStorage.get_logs("pt_test", "run_a")
    assert [r["step"] for r in logged] == [1, 2]
    for got, want in zip(logged, rows):
        assert got["grpo/score/mean"] == want["grpo/score/mean"] and got["actor/pg_loss"] == want["actor/pg_loss"]


def test_mlflow_holds_every_iteration_and_the_config_in_a_local_file_store(tmp_path):
    pytest.importorskip("mlflow", reason="pip install 'posttrain[trackers]'")
    from mlflow.tracking import MlflowClient

    rows = log_run(tmp_path / "run_b", mlflow_uri="", mlflow_experiment="pt_test")
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'run_b' / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pt_test").experiment_id])
    assert run.info.run_name == "run_b" and run.info.status == "FINISHED"
    assert run.data.params["rl_config.n_samples_per_prompt"] == "8"
    history = client.get_metric_history(run.info.run_id, "grpo/score/mean")
    assert [(m.step, m.value) for m in history] == [(r["iteration"], r["grpo/score/mean"]) for r in rows]


def test_a_tracker_without_its_package_is_refused_naming_the_extra(monkeypatch):
    from posttrain import extras
    from posttrain.config.check import Refusals, collect_checks
    from posttrain.config.run import load_run_config

    monkeypatch.setattr(extras, "installed", lambda module: module not in ("trackio", "mlflow"))
    refusals = Refusals()
    collect_checks(load_run_config("grpo_tiny_qwen2", overrides=["rl_config.use_trackio=true",
                                                                  "rl_config.use_mlflow=true"]), refusals)
    assert sum("pip install 'posttrain[trackers]'" in m for m in refusals.messages) == 2, refusals.messages


def test_swanlab_local_mode_holds_every_iteration_without_network(tmp_path, monkeypatch):
    pytest.importorskip("swanlab", reason="pip install 'posttrain[trackers]'")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # swanlab writes its settings under $HOME
    rows = log_run(tmp_path / "run_c", swanlab=("local", "pt_test", "", str(tmp_path / "swan")))
    (run,) = (tmp_path / "swan").glob("run-*")
    series = sorted(([json.loads(line) for line in (d / "1000.log").read_text().splitlines()]
                     for d in (run / "logs").iterdir()), key=lambda s: [p["data"] for p in s])
    want = sorted(([{"index": r["iteration"], "data": r[key]} for r in rows] for key in ROWS[1]),
                  key=lambda s: [p["data"] for p in s])
    assert [[{"index": p["index"], "data": p["data"]} for p in s] for s in series] == want
    record = (run / f"run-{run.name.rsplit('-', 1)[1]}.swanlab").read_bytes()
    assert all(key.encode() in record for key in ROWS[1])  # the series' names, in the run's record


def test_swanlab_modes_are_the_seeds(monkeypatch):
    from posttrain.config.check import check_swanlab
    from posttrain.config.run import load_run_config
    from posttrain.errors import ConfigError

    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="export SWANLAB_API_KEY"):
        check_swanlab(load_run_config("grpo_tiny_qwen2", overrides=["rl_config.use_swanlab=true",
                                                                     "rl_config.swanlab_mode=cloud"]))
    with pytest.raises(ConfigError, match="use local"):
        check_swanlab(load_run_config("grpo_tiny_qwen2", overrides=["rl_config.use_swanlab=true",
                                                                     "rl_config.swanlab_mode=offline"]))
    check_swanlab(load_run_config("grpo_tiny_qwen2", overrides=["rl_config.use_swanlab=true"]))
