"""Tracking: console format, and a real MLflow run in a SQLite store read back with the MLflow client."""
import io
import time

import pytest
import torch

from mrl.config.root import MRLConfig
from mrl.observability import Tracking, flatten


def test_flatten_and_console_sink():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": "x"}) == {"a.b": 1, "a.c.d": [1, 2], "e": "x"}
    buf = io.StringIO()
    t = Tracking("p", "e", ["console"], stream=buf)
    t.log({"timing_s/gen": 1.23456, "critic/score/mean": torch.tensor(0.5), "skip": "text", "v": torch.ones(2)}, step=3)
    assert buf.getvalue() == "step:3 - critic/score/mean:0.5 - timing_s/gen:1.235\n"
    buf.truncate(0), buf.seek(0)
    t.log_generations([{"input": "1+2=", "output": "3", "score": 1.0}], step=4)
    assert buf.getvalue() == "val_generation step:4 #0 score:1\n[input] 1+2=\n[output] 3\n"
    with pytest.raises(ValueError, match=r"trainer.logger has unknown sinks \['wandb'\]"):
        Tracking("p", "e", ["wandb"])


def test_mlflow_sqlite_run_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = f"sqlite:///{tmp_path}/ml/mlflow.db"
    cfg = MRLConfig.model_validate({"trainer": {"logger": ["mlflow"], "mlflow_tracking_uri": uri,
                                                "project_name": "proj", "experiment_name": "run1"},
                                    "actor": {"optim": {"lr": 3e-6}}})
    t = Tracking.from_config(cfg)
    for step in (1, 2):
        t.log({"critic/score/mean": 0.25 * step, "timing_s/gen": float(step), "bad": float("nan"),
               "val-core/arith/reward/mean@1": 0.5}, step=step)
    rows = [{"input": "1+2=", "output": "3 é", "score": 1.0}, {"input": "2*3=", "output": "5", "score": 0.0}]
    t.log_generations(rows, step=2)
    t.finish()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("proj")
    assert exp.artifact_location.startswith("file://") and str(tmp_path) in exp.artifact_location
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run1" and run.info.status == "FINISHED"
    assert run.data.params["actor.optim.lr"] == "3e-06"
    assert run.data.params["trainer.experiment_name"] == "run1"
    assert len(run.data.params) == len(flatten(cfg.model_dump(mode="json")))
    hist = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(h.step, h.value) for h in hist] == [(1, 0.25), (2, 0.5)]
    assert "bad" not in run.data.metrics and run.data.metrics["timing_s/gen"] == 2.0
    assert run.data.metrics["val-core/arith/reward/mean_at_1"] == 0.5  # verl's '@' name, sanitised
    # verl's validation-generations artifact: val_step<N>.json = [{input, output, score}]
    import json
    from pathlib import Path

    local = client.download_artifacts(run.info.run_id, "val_step2.json", str(tmp_path / "dl"))
    assert json.loads(Path(local).read_text(encoding="utf-8")) == rows
    # A second run of the same project lands in the same experiment.
    Tracking("proj", "run2", ["mlflow"], mlflow_tracking_uri=uri).finish("FAILED")
    assert sorted(r.info.run_name for r in client.search_runs([exp.experiment_id])) == ["run1", "run2"]


def test_resumed_run_continues_the_killed_mlflow_run(tmp_path, monkeypatch, caplog):
    # issue 19: a killed run stayed RUNNING forever and the resumed one started a second run
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    killed = Tracking("proj", "r", ["mlflow"], config={"a": 1}, mlflow_tracking_uri=uri)
    killed.log({"x": 1.0}, step=1)
    killed.flush()  # as the trainer does after a checkpoint's step ... then the process dies: no finish()
    run_id = killed.mlflow_run_id
    resumed = Tracking("proj", "r", ["mlflow"], config={"a": 2}, mlflow_tracking_uri=uri, resume_run_id=run_id)
    assert resumed.mlflow_run_id == run_id
    resumed.log({"x": 2.0}, step=2)
    resumed.finish()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED" and run.data.params == {"a": "1"}
    assert [(h.step, h.value) for h in client.get_metric_history(run_id, "x")] == [(1, 1.0), (2, 2.0)]
    # a run id from another store: a new run, with a warning
    with caplog.at_level("WARNING", logger="mrl.observability"):
        other = Tracking("proj", "r", ["mlflow"], mlflow_tracking_uri=f"sqlite:///{tmp_path}/other.db",
                         resume_run_id=run_id)
    assert other.mlflow_run_id != run_id and "logging to a new run" in caplog.text
    other.finish()


def test_metric_writes_run_behind_the_steps_and_their_errors_surface(tmp_path, monkeypatch):
    """MlflowSink.log queues a step's metrics and returns; a writer thread stores every queued step in
    one write (at most every METRICS_WRITE_INTERVAL_S), flush/finish store the rest at once, and a failed
    write raises — from flush, or from the next log after the writer met it."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from mrl.observability.tracking import MlflowSink

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    history = lambda run_id: [(m.step, m.value) for m in client.get_metric_history(run_id, "a")]
    sink = MlflowSink(uri, "proj", "r")
    sink.log({"a": 1.0}, step=1)
    sink.log({"a": 2.0}, step=2)
    sink.flush()
    assert sink._pending == [] and history(sink.run_id) == [(1, 1.0), (2, 2.0)]
    for step in (3, 4, 5):
        sink.log({"a": float(step)}, step=step)
    deadline = time.monotonic() + 60  # the writer thread stores them without a flush
    while len(history(sink.run_id)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert history(sink.run_id) == [(s, float(s)) for s in range(1, 6)]
    client.delete_run(sink.run_id)  # a write that MLflow refuses: logging to a deleted run
    sink.log({"a": 6.0}, step=6)
    with pytest.raises(MlflowException):
        sink.flush()

    other = MlflowSink(uri, "proj", "r2")  # the writer thread meets the error: the next log raises it
    client.delete_run(other.run_id)
    other.log({"a": 1.0}, step=1)
    deadline = time.monotonic() + 60
    while other._error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(MlflowException):
        other.log({"a": 2.0}, step=2)
