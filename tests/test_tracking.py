"""MLflow tracking against a real tracking server on 127.0.0.1 (SQLite store) and a local store.

One model_dir is one MLflow run: stopped by SIGTERM and rerun, it continues that run,
and each step's metrics are in MLflow once (``trainer/tracking.py``).
"""

import functools
import http.server
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import keras
import pytest

from datasets import digits
from models.mlp import MLP
from tests.support.commands import REPO, run_cli
from tests.support.helpers import http_served
from trainer import Checkpoints, Estimator
from trainer.distributed.launcher import free_ports
from trainer.errors import UserError
from trainer.tracking import MLflow

mlflow = pytest.importorskip("mlflow", reason="MLflow is the [mlflow] extra")
DIGITS = ["--gin_file", os.path.join(REPO, "experiments", "digits_mlp.gin")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` on 127.0.0.1 with a SQLite store, for this module's tests."""
    root = tmp_path_factory.mktemp("mlflow")
    (port,) = free_ports(1)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{root}/mlflow.db",
            "--artifacts-destination",
            str(root / "artifacts"),
        ],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "w"),  # noqa: SIM115
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                break
        except OSError:
            assert process.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.5)
    yield uri
    process.terminate()
    process.wait(timeout=30)


def steps(client, run_id, key):
    return [m.step for m in client.get_metric_history(run_id, key)]


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_and_rerun_is_one_mlflow_run_each_step_once(tmp_path, server):
    """The command line with --tracking_uri: SIGTERM after the first checkpoint, rerun;
    one MLflow run holds the params, each log step's train metrics and each evaluation
    once, operative_config.gin and the results file."""
    model_dir = tmp_path / "run"
    args = [*DIGITS, "--model_dir", str(model_dir), "--tracking_uri", server]
    args += [
        "--gin_param",
        "experiment.max_steps = 1000",
        "--gin_param",
        "MLflow.experiment = 'cli'",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stdout:
        if line.startswith("Saved checkpoint"):
            process.send_signal(signal.SIGTERM)
            break
    _, err = process.communicate(timeout=120)
    assert process.returncode == 75, err
    client = mlflow.tracking.MlflowClient(server)
    (stopped,) = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert stopped.info.status == "KILLED"
    assert steps(client, stopped.info.run_id, "train/loss") == [200, 400]  # the checkpoint's

    done = run_cli(*args, "--results", str(tmp_path / "results.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert run.info.run_id == stopped.info.run_id and run.info.status == "FINISHED"
    assert steps(client, run.info.run_id, "train/loss") == [200, 400, 600, 800, 1000]
    assert steps(client, run.info.run_id, "eval_eval/accuracy") == [500, 1000]
    history = client.get_metric_history(run.info.run_id, "eval_eval/accuracy")
    results = json.loads((tmp_path / "results.json").read_text())
    assert history[-1].value == pytest.approx(results["metrics"]["eval"]["accuracy"])
    assert run.data.params["MLP.hidden_units"] == "[256, 256]"
    assert run.data.params["Adam.learning_rate"] == "0.001"
    assert "experiment.max_steps" not in run.data.params  # extending a run keeps it one
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"operative_config.gin", "results.json"} <= artifacts


@pytest.mark.slow
def test_an_estimator_extended_from_python_continues_its_run_in_a_local_store(tmp_path, data_dir):
    """MLflow("sqlite:///...") from Python: train to 10, then on to 20 with a new
    Estimator; one run, each step once, the settings groups as params."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    input_fn = functools.partial(digits.input_fn, data_dir=data_dir)
    for max_steps in (10, 20):
        keras.utils.set_random_seed(0)
        estimator = Estimator(
            MLP(hidden_units=[16]),
            str(tmp_path / "run"),
            global_batch_size=32,
            log_every_steps=5,
            checkpoints=Checkpoints(every_steps=10),
            progress=False,
            tracker=(tracker := MLflow(uri, experiment="python")),
        )
        estimator.train_and_evaluate(input_fn, input_fn, max_steps, eval_steps=1)
    (tmp_path / "notes.txt").write_text("kept")
    tracker.artifact(str(tmp_path / "notes.txt"))
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("python").experiment_id])
    assert steps(client, run.info.run_id, "train/loss") == [5, 10, 15, 20]
    assert steps(client, run.info.run_id, "eval_eval/loss") == [10, 20]
    assert run.data.params["Checkpoints.every_steps"] == "10"
    assert run.info.status == "FINISHED"
    artifacts = tmp_path / "mlartifacts"  # beside the store, not ./mlruns of the cwd
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"notes.txt"}
    assert client.get_experiment_by_name("python").artifact_location.endswith(str(artifacts))
    assert run.info.artifact_uri.startswith(f"{artifacts}/"), run.info.artifact_uri
    assert (artifacts / run.info.run_id / "artifacts" / "notes.txt").read_text() == "kept"


@pytest.mark.slow
def test_an_unreachable_tracking_server_is_one_line_before_training(tmp_path):
    (port,) = free_ports(1)
    done = run_cli(
        *DIGITS,
        "--model_dir",
        str(tmp_path / "run"),
        "--tracking_uri",
        f"http://127.0.0.1:{port}",
    )
    assert done.returncode == 2
    assert done.stderr.startswith(
        f"error: the MLflow tracking server at http://127.0.0.1:{port} does not answer ("
    )
    assert done.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")


class _NotMLflow(http.server.BaseHTTPRequestHandler):
    """A web server that answers /health as MLflow's does, and nothing else."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK" if self.path == "/health" else b"<html>not found</html>")

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def not_mlflow():
    with http_served(_NotMLflow) as address:
        yield address


@pytest.mark.parametrize("store", ["file", "scheme", "foreign"])
def test_a_store_mlflow_refuses_is_one_line_before_training(store, tmp_path, not_mlflow):
    """A file: store (MLflow 3.17 refuses them), a misspelt scheme, and a web server that
    answers /health but is not MLflow: each refused before anything trains."""
    uri = {
        "file": f"file:{tmp_path}/mlruns",
        "scheme": "htp://127.0.0.1:5000",
        "foreign": not_mlflow,
    }[store]
    with pytest.raises(UserError) as refused:
        MLflow(uri).check()
    said = str(refused.value)
    assert "\n" not in said and said.startswith(f"MLflow cannot record to {uri} ("), said
    assert said.endswith(
        "give --tracking_uri a database store (sqlite:///mlflow.db) or an MLflow tracking "
        "server (http://127.0.0.1:5000)"
    )
    if store == "file":
        assert "MLFLOW_ALLOW_FILE_STORE=true" in said
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.slow
def test_a_refused_store_ends_the_command_with_one_line_and_no_model_dir(tmp_path):
    uri = f"file:{tmp_path}/mlruns"
    done = run_cli(*DIGITS, "--model_dir", str(tmp_path / "run"), "--tracking_uri", uri)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: MLflow cannot record to {uri} ("), done.stderr
    assert done.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_sweep_is_one_parent_run_with_a_child_per_trial(tmp_path, server):
    sweep_dir = tmp_path / "sweep"
    done = run_cli(
        *DIGITS,
        "--gin_file",
        os.path.join(REPO, "experiments", "smoke.gin"),
        "--model_dir",
        str(sweep_dir),
        "--tracking_uri",
        server,
        "--gin_param",
        "experiment.eval_steps = 1",
        "--sweep",
        "Adam.learning_rate = [1e-3, 1e-2]",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    client = mlflow.tracking.MlflowClient(server)
    experiment = client.get_experiment_by_name("trainer").experiment_id
    (parent,) = client.search_runs([experiment], "tags.mlflow.runName = 'sweep'")
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.params["Adam.learning_rate"] for c in children) == ["0.001", "0.01"]
    assert parent.info.status == "FINISHED"
