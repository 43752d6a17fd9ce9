"""Runs recorded in MLflow: params, train and eval metrics by step, artifacts.

``Estimator(..., tracker=MLflow("http://127.0.0.1:5000"))``, or on the command line
``--tracking_uri`` (gin: ``experiment.tracker = @MLflow()``). MLflow is an optional
extra: ``pip install -e ".[mlflow]"``.

One model_dir is one MLflow run. Its id is kept in ``model_dir/mlflow.json``, so a
preempted, resumed or extended run continues the same MLflow run. Metrics are sent as
``metrics.jsonl`` keeps them: a training run holds them until a checkpoint covers
their step, then sends them (``commit``), so that the steps a resumed run trains again
are sent once; each TensorBoard directory's metrics (``train``, ``eval_<name>``) go
as ``<directory>/<metric>``, and a step sent once is not sent again. The params are
the run's operative gin bindings as the HParams tab has them (the Estimator's settings
groups from Python); the artifacts, ``operative_config.gin``, the best exports and the
command line's results file. A model_dir inside a sweep's is a child of the sweep's
run. Under several workers the chief records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

import tensorflow as tf
from absl import logging

from trainer import checkpoints, errors, whole_files
from trainer.errors import UserError

RECORD = "mlflow.json"  # in model_dir: the MLflow run it records to
DEFAULT_EXPERIMENT = "trainer"


def _mlflow():
    """The mlflow package, or one line saying how to get it."""
    try:
        import mlflow  # noqa: PLC0415 (an optional extra, slow to import)
    except ImportError:
        raise UserError(
            'tracking with MLflow needs the mlflow package: pip install -e ".[mlflow]"'
        ) from None
    return mlflow


class MLflow:
    """Records one model_dir's training in an MLflow run.

    Args:
      tracking_uri: an MLflow tracking server (``http://127.0.0.1:5000``) or database
        store (``sqlite:///mlflow.db``); None takes MLflow's own default
        (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``). MLflow 3.17 refuses
        ``file:`` stores unless ``MLFLOW_ALLOW_FILE_STORE=true``. The artifacts of a
        run in a database store go beside it (``mlartifacts/``); a server keeps its own.
      experiment: the MLflow experiment's name.
      run_name: the run's name; default the model_dir's name.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = DEFAULT_EXPERIMENT,
        run_name: str | None = None,
    ):
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.model_dir: str | None = None
        self.params: Callable[[], Mapping[str, Any]] | None = None
        self.client = None
        self.run_id: str | None = None
        self.sent: dict[str, int] = {}  # by key: the last step sent
        self.pending: list[tuple[str, int, float, float]] = []  # (key, step, value, time)
        self.holding = False  # training: metrics wait for a checkpoint
        self.started = time.time()  # when training started: the run's start

    def bind(self, model_dir: str, params: Callable[[], Mapping[str, Any]]) -> None:
        """The model_dir recorded, and its params unless given before (the command line's).

        The params are asked for when the run is opened.
        """
        if model_dir != self.model_dir:  # another model_dir is another run
            self.run_id, self.sent, self.pending = None, {}, []
        self.model_dir = model_dir
        self.params = self.params or params

    def check(self) -> None:
        """Refuses, in one line, a server that does not answer or a store MLflow refuses.

        Called before training: a run that trains for hours and records nothing is
        worse than a run that does not start.
        """
        mlflow = _mlflow()
        self.started = time.time()
        uri = self._uri()
        if uri.startswith(("http://", "https://")):
            try:
                with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=10):
                    pass
            except (urllib.error.URLError, OSError) as error:
                reason = getattr(error, "reason", error)
                raise UserError(
                    f"the MLflow tracking server at {uri} does not answer ({reason}): start "
                    "it (mlflow server --host 127.0.0.1 --port 5000) or fix --tracking_uri"
                ) from None
        try:
            self.client = self.client or mlflow.tracking.MlflowClient(self.tracking_uri)
            self.client.search_experiments(max_results=1)
        except Exception as error:  # MlflowException, an unknown scheme, a foreign server
            raise UserError(refusal(uri, error)) from None

    def hold(self, holding: bool) -> None:
        """While training, metrics wait for the checkpoint of their step (``commit``)."""
        self.holding = holding
        if not holding:
            self.commit(None)

    def drop(self) -> None:
        """Training failed: the metrics held (after its last checkpoint) are not sent."""
        self.pending, self.holding = [], False

    def record(self, directory: str, step: int, values: Mapping[str, float]) -> None:
        """Metrics of TensorBoard directory ``directory`` at ``step``: sent, or held."""
        now = int(time.time() * 1000)
        for name, value in values.items():
            self.pending.append((f"{directory}/{name}", int(step), float(value), now))
        if not self.holding:
            self.commit(None)

    def commit(self, step: int | None) -> None:
        """Sends the metrics held up to ``step`` (None: all) that were not sent before.

        If MLflow fails now (the server went away), training goes on: the log says so,
        and the metrics wait for the next commit.
        """
        ready = [m for m in self.pending if step is None or m[1] <= step]
        if not ready:
            return
        with self._failing_softly(f"send the metrics up to step {ready[-1][1]}"):
            self._open()
            new = [m for m in ready if m[1] > self.sent.get(m[0], -1)]
            metrics = [self._metric(key, value, when, at) for key, at, value, when in new]
            for start in range(0, len(metrics), 1000):  # MLflow's batch limit
                self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])
            for key, at, _, _ in new:
                self.sent[key] = max(at, self.sent.get(key, -1))
            self.pending = [m for m in self.pending if step is not None and m[1] > step]
            self._write_record()

    def finish(self, status: str) -> None:
        """The run ended (``FINISHED``, ``KILLED`` or ``FAILED``): held metrics, artifacts."""
        if self.run_id is None and not self.pending:
            return  # nothing was recorded: no run was made
        self.holding = False
        self.commit(None)
        with self._failing_softly(f"mark run {self.run_id or '(not made)'} {status}"):
            for name in (checkpoints.OPERATIVE_CONFIG, os.path.join("export", "best")):
                path = os.path.join(self.model_dir, name)
                if tf.io.gfile.isdir(path):
                    self.client.log_artifacts(self.run_id, path, name)
                elif tf.io.gfile.exists(path):
                    self.client.log_artifact(self.run_id, path)
            self.client.set_terminated(self.run_id, status)

    def artifact(self, path: str) -> None:
        """Adds a file (the command line's results file) to the run, if there is one."""
        with self._failing_softly(f"keep {path}"):
            self._open()
            self.client.log_artifact(self.run_id, path)

    @contextlib.contextmanager
    def _failing_softly(self, what: str):
        """MLflow's failures after the start are warnings: training is worth more."""
        try:
            yield
        except UserError:
            raise
        except Exception as error:  # MlflowException, a connection error, ...
            logging.warning("MLflow: could not %s (%s)", what, errors.first_line(error))

    def _metric(self, key: str, value: float, when: int, step: int):
        return _mlflow().entities.Metric(key, value, when, step)

    def _open(self) -> None:
        """The model_dir's MLflow run: the one its record names, else a new one."""
        if self.run_id is not None:
            return
        mlflow = _mlflow()
        self.client = self.client or mlflow.tracking.MlflowClient(self.tracking_uri)
        record = _read(self.model_dir)
        if record.get("tracking_uri") == self._uri() and record.get("run_id"):
            self.run_id, self.sent = record["run_id"], dict(record.get("sent", {}))
            if self.holding:  # training again
                self.client.update_run(self.run_id, status="RUNNING")
            logging.info("MLflow: continuing run %s at %s", self.run_id, self._uri())
            self._log_params(self.params() if self.params else {})
            return
        tags = {"mlflow.runName": self.run_name or os.path.basename(self.model_dir.rstrip("/"))}
        parent = _read(os.path.dirname(os.path.abspath(self.model_dir)))
        if parent.get("tracking_uri") == self._uri() and parent.get("sweep"):
            tags["mlflow.parentRunId"] = parent["run_id"]
        started = int(self.started * 1000)
        run = self.client.create_run(self._experiment_id(), start_time=started, tags=tags)
        self.run_id, self.sent = run.info.run_id, {}
        logging.info("MLflow: run %s at %s", self.run_id, self._uri())
        self._write_record()
        self._log_params(self.params() if self.params else {})

    def _uri(self) -> str:
        return self.tracking_uri or _mlflow().get_tracking_uri()

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        return self.client.create_experiment(
            self.experiment, artifact_location=artifacts_beside(self._uri())
        )

    def _log_params(self, params: Mapping[str, Any]) -> None:
        """Logs the params the run does not have yet; says which differ from its own."""
        have = self.client.get_run(self.run_id).data.params
        entity = _mlflow().entities.Param
        new = [entity(k, str(v)[:6000]) for k, v in params.items() if k not in have]
        changed = sorted(k for k, v in params.items() if k in have and have[k] != str(v)[:6000])
        for start in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[start : start + 100])
        if changed:
            logging.warning(
                "MLflow run %s keeps its first values of %s (MLflow params do not change)",
                self.run_id,
                ", ".join(changed),
            )

    def _write_record(self) -> None:
        whole_files.write_json(
            os.path.join(self.model_dir, RECORD),
            {"tracking_uri": self._uri(), "run_id": self.run_id, "sent": self.sent},
        )


def refusal(uri: str, error: Exception) -> str:
    """The one line for a tracking URI MLflow cannot record to, and what to use instead."""
    said = errors.first_line(error)
    if "maintenance mode" in said:  # MLflow >= 3.17 and a file: store
        said = "MLflow no longer records to file stores unless MLFLOW_ALLOW_FILE_STORE=true"
    elif len(said) > 200:
        said = said[:200] + "..."
    return (
        f"MLflow cannot record to {uri} ({said}): give --tracking_uri a database store "
        "(sqlite:///mlflow.db) or an MLflow tracking server (http://127.0.0.1:5000)"
    )


def artifacts_beside(uri: str) -> str | None:
    """Where a new experiment's artifacts go: beside a local database, else the store's choice.

    MLflow's client puts a database store's artifacts in ``./mlruns`` of whatever
    directory the run was started from.
    """
    if not uri.startswith("sqlite:///"):
        return None
    database = uri[len("sqlite:///") :]
    if not database or database.startswith(":memory:"):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(database)), "mlartifacts")


def sweep_run(tracker: MLflow, sweep_dir: str, params: Mapping[str, Any]) -> None:
    """Opens the sweep's parent run, kept in ``sweep_dir`` (its trials' runs are children)."""
    tracker.bind(sweep_dir, lambda: params)
    tracker.holding = True  # running: its trials are
    tracker._open()
    tracker.holding = False
    whole_files.write_json(
        os.path.join(sweep_dir, RECORD),
        {"tracking_uri": tracker._uri(), "run_id": tracker.run_id, "sweep": True},
    )


def settings_params(groups, **plain) -> dict[str, Any]:
    """The Estimator's settings as params: ``{'Estimator.seed': 0, 'Checkpoints.keep': 5}``."""
    params = {f"Estimator.{name}": value for name, value in plain.items()}
    for group in groups:
        for field in dataclasses.fields(group):
            value = getattr(group, field.name)
            if value is None or isinstance(value, bool | int | float | str):
                params[f"{type(group).__name__}.{field.name}"] = value
    return params


def _read(directory: str) -> dict:
    try:
        record = whole_files.read_json(os.path.join(directory, RECORD), {})
    except whole_files.Unreadable as error:
        logging.warning("%s: a new MLflow run is made", error)
        return {}
    return record if isinstance(record, dict) else {}


@contextlib.contextmanager
def tracked(tracker: MLflow | None):
    """Around a training call: the tracker checked first, its run's status after."""
    if tracker is None:
        yield
        return
    tracker.check()
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    except errors.Preempted:
        status = "KILLED"  # resumed by rerunning the command
        raise
    finally:
        tracker.finish(status)
