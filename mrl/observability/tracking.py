"""Metric logging to console and MLflow (verl ``Tracking``: one ``log(metrics, step)`` for all sinks).

MLflow uses its SQLite store (``trainer.mlflow_tracking_uri``, e.g. ``sqlite:///mlruns/mlflow.db``;
no server): experiment = ``trainer.project_name``, run = ``trainer.experiment_name``, params = the
resolved config flattened to dotted keys. Telemetry is switched off (MLFLOW_DISABLE_TELEMETRY).
The ``MlflowClient`` API is used instead of mlflow's fluent globals, so two trackers never share
an "active run".
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import torch

_MLFLOW_PARAM_MAX = 6000  # characters MLflow 3 stores per param value
_MLFLOW_BATCH = 100  # params per log_batch call (MLflow's limit)
_MLFLOW_METRICS_BATCH = 1000  # metrics per log_batch call (MLflow's limit)
# Metrics are written by one background thread at most this often: one SQLite transaction for every
# step since the last write. A write per step through MLflow's async queue took CPU in its 3 threads
# from the engines and ranks on the other side of the step; batching the steps takes far less
# (docs/performance.md, 'MLflow metrics written at most once a second').
METRICS_WRITE_INTERVAL_S = 1.0
log = logging.getLogger("mrl.observability")
metrics_log = logging.getLogger("mrl.metrics")


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} → {'a.b': 1}; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out |= flatten(v, key + ".")
        else:
            out[key] = v
    return out


def _scalar(v: Any) -> float | None:
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else None
    if isinstance(v, bool | int | float):
        return float(v)
    return None


class ConsoleSink:
    """One line per step, ``step:N - key:value - ...`` (verl's console format), keys sorted; also
    logged at DEBUG level to ``mrl.metrics`` (a training run writes these lines to
    ``<run dir>/metrics.log`` and shows a short progress line instead: mrl/observability/progress.py)."""

    def __init__(self, stream: TextIO | None = None, path: str | Path | None = None) -> None:
        self.stream, self.path = stream, Path(path) if path is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        parts = [f"{k}:{v:.4g}" for k, v in sorted(metrics.items())]
        line = " - ".join([f"step:{step}", *parts])
        if self.path is not None:  # a training run: the file, not the console
            try:
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError as e:  # a full disk: name the file (a write's OSError carries no filename)
                if e.filename is not None:
                    raise
                raise OSError(e.errno, e.strerror, str(self.path)) from e
        else:
            print(line, file=self.stream or sys.stdout, flush=True)
        metrics_log.debug(line)

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        out = self.stream or sys.stdout
        for i, r in enumerate(rows):
            print(f"val_generation step:{step} #{i} score:{r['score']:.4g}\n[input] {r['input']}\n[output] {r['output']}",
                  file=out, flush=True)

    def finish(self) -> None:
        pass


def _sqlite_parent(uri: str) -> Path | None:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).parent
    return None


class MlflowSink:
    """An MLflow run in ``tracking_uri``: experiment ``project_name``, run ``experiment_name``."""

    def __init__(self, tracking_uri: str, project_name: str, experiment_name: str,
                 params: Mapping[str, Any] | None = None, resume_run_id: str | None = None) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        parent = _sqlite_parent(tracking_uri)
        artifact_location = None
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
            # Keep artifacts beside the database instead of MLflow's default under the cwd.
            artifact_location = (parent / "artifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self._pending: list[Any] = []  # metrics logged and not yet written (guarded by _lock)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one write at a time, in order
        self._error: BaseException | None = None  # a failed background write, raised by the next log/flush
        self._wake = threading.Event()
        self._stop = False
        self._writer: threading.Thread | None = None
        exp = self.client.get_experiment_by_name(project_name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
            project_name, artifact_location=artifact_location)
        if resume_run_id is not None and self._reopen(resume_run_id, exp_id):
            return
        self.run_id = self.client.create_run(exp_id, run_name=experiment_name).info.run_id
        items = [Param(k, str(v)[:_MLFLOW_PARAM_MAX]) for k, v in sorted(flatten(params or {}).items())]
        for i in range(0, len(items), _MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _MLFLOW_BATCH])

    def _reopen(self, run_id: str, exp_id: str) -> bool:
        """Continue the run a resumed checkpoint was written by (a killed run stays RUNNING in MLflow
        otherwise, and its curve would be split over two runs). Params are not re-logged: MLflow
        refuses changed values, and the run already holds the config it started with."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            run = None
        if run is None or run.info.experiment_id != exp_id or run.info.lifecycle_stage != "active":
            log.warning("the checkpoint's MLflow run %s is not in %s (experiment %s): logging to a new run",
                        run_id, self.client.tracking_uri, exp_id)
            return False
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")
        log.info("resumed MLflow run %s", run_id)
        return True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        self._raise_failed_write()
        now = int(time.time() * 1000)
        # MLflow refuses '@' in metric names; verl's MLflow logger writes it as '_at_' too.
        batch = [Metric(k.replace("@", "_at_"), v, now, step) for k, v in sorted(metrics.items()) if math.isfinite(v)]
        # Queued for the writer thread (METRICS_WRITE_INTERVAL_S); a write error surfaces at the next
        # log, flush or finish, never silently.
        with self._lock:
            self._pending.extend(batch)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="mrl-mlflow-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while not self._stop:
            self._wake.wait(METRICS_WRITE_INTERVAL_S)
            self._wake.clear()
            try:
                self._write_pending()
            except BaseException as e:  # noqa: BLE001 - kept for the caller's thread (log/flush/finish raise it)
                self._error = e
                return

    def _write_pending(self) -> None:
        with self._write_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            for i in range(0, len(batch), _MLFLOW_METRICS_BATCH):
                self.client.log_batch(self.run_id, metrics=batch[i:i + _MLFLOW_METRICS_BATCH])

    def _raise_failed_write(self) -> None:
        if self._error is not None:
            raise self._error

    def flush(self) -> None:
        """Block until every metric logged so far is in the store (raises MLflow's error if a write failed)."""
        self._raise_failed_write()
        self._write_pending()

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        # verl's MLflow validation logger writes the same artifact: val_step<N>.json, [{input, output, score}]
        self.client.log_text(self.run_id, json.dumps(rows, ensure_ascii=False), f"val_step{step}.json")

    def log_artifact(self, path: str | Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str = "FINISHED") -> None:
        self._stop = True
        self._wake.set()
        try:
            if self._writer is not None:
                self._writer.join(timeout=60)
            self.flush()  # a failed write still raises, after the run is closed
        finally:
            self.client.set_terminated(self.run_id, status=status)


class Tracking:
    """Fan ``log(metrics, step)`` out to the sinks named in ``backends`` (console | mlflow)."""

    def __init__(self, project_name: str, experiment_name: str, backends: list[str] | tuple[str, ...] = ("console",),
                 config: Mapping[str, Any] | None = None, mlflow_tracking_uri: str = "sqlite:///mlruns/mlflow.db",
                 stream: TextIO | None = None, resume_run_id: str | None = None,
                 metrics_path: str | Path | None = None) -> None:
        unknown = sorted(set(backends) - {"console", "mlflow"})
        if unknown:
            raise ValueError(f"trainer.logger has unknown sinks {unknown}; valid: console, mlflow")
        self.sinks: list[ConsoleSink | MlflowSink] = []
        if "console" in backends:
            self.sinks.append(ConsoleSink(stream, metrics_path))
        if "mlflow" in backends:
            self.sinks.append(MlflowSink(mlflow_tracking_uri, project_name, experiment_name, config, resume_run_id))

    @classmethod
    def from_config(cls, cfg: Any, stream: TextIO | None = None, resume_run_id: str | None = None,
                    metrics_path: str | Path | None = None) -> Tracking:
        """From an ``MRLConfig``: sinks ``trainer.logger``, params = the whole resolved config;
        ``resume_run_id``: the MLflow run of the checkpoint being resumed (continued when present);
        ``metrics_path``: the console sink's lines go to this file instead of the console."""
        t = cfg.trainer
        return cls(t.project_name, t.experiment_name, list(t.logger), config=cfg.model_dump(mode="json"),
                   mlflow_tracking_uri=t.mlflow_tracking_uri, stream=stream, resume_run_id=resume_run_id,
                   metrics_path=metrics_path)

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run written to (kept in trainer_state.json so that a resume continues it)."""
        return next((s.run_id for s in self.sinks if isinstance(s, MlflowSink)), None)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log the scalar entries of ``metrics`` (numbers or 1-element tensors) at ``step``."""
        clean = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        for sink in self.sinks:
            sink.log(clean, step)

    def flush(self) -> None:
        """Store every metric logged so far (MLflow writes them in the background otherwise)."""
        for sink in self.sinks:
            if isinstance(sink, MlflowSink):
                sink.flush()

    def log_generations(self, rows: list[dict[str, Any]], step: int) -> None:
        """Validation samples ``[{"input", "output", "score"}]`` (verl ``trainer.log_val_generations``):
        printed by the console sink, an artifact ``val_step<step>.json`` of the MLflow run."""
        for sink in self.sinks:
            sink.log_generations(rows, step)

    def log_artifact(self, path: str | Path) -> None:
        """A file (e.g. the learning-curve PNG) as an artifact of the MLflow run; nothing without MLflow."""
        for sink in self.sinks:
            if isinstance(sink, MlflowSink):
                sink.log_artifact(path)

    def finish(self, status: str = "FINISHED") -> None:
        """Close the MLflow run (``FINISHED`` or ``FAILED``)."""
        for sink in self.sinks:
            if isinstance(sink, MlflowSink):
                sink.finish(status)
            else:
                sink.finish()
