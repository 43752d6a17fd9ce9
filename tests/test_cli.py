"""``python -m trainer`` as a user runs it: subprocesses, real files, exit codes, messages."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf

from tests.conftest import REPO, digits_args, run_cli
from tests.helpers import checkpoint_steps, event_tags

DIGITS = "experiments/digits_mlp.gin"


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_default_experiment_reaches_accuracy_then_resumes(tmp_path, data_dir):
    """The README's first command: >= 0.95 eval accuracy; a rerun trains nothing."""
    model_dir, results = tmp_path / "run", tmp_path / "results.json"
    proc = run_cli(*digits_args(data_dir, model_dir, "--results", str(results)))
    assert_ok(proc)
    assert f"model_dir {model_dir}" in proc.stdout
    first = json.loads(results.read_text())
    assert first["global_step"] == 2000
    assert first["metrics"]["eval"]["accuracy"] >= 0.95
    assert "step 1000/2000" in proc.stdout and "examples/s" in proc.stdout and "ETA" in proc.stdout
    noise = ("E0000", "W0000", "I0000", "WARNING: All log messages", "Sharding callback")
    assert not [
        line
        for line in proc.stderr.splitlines() + proc.stdout.splitlines()
        if line.startswith(noise)
    ]  # TensorFlow's start-up chatter is held back
    assert {"loss", "accuracy", "learning_rate", "steps_per_sec"} <= event_tags(model_dir / "train")
    assert {"loss", "accuracy"} <= event_tags(model_dir / "eval_eval")
    operative = (model_dir / "operative_config.gin").read_text()
    assert (
        "MLP.hidden_units = [256, 256]" in operative and "experiment.max_steps = 2000" in operative
    )

    saved = {
        s: os.path.getmtime(model_dir / f"ckpt-{s}.index") for s in checkpoint_steps(model_dir)
    }
    proc = run_cli(*digits_args(data_dir, model_dir, "--results", str(results)))
    assert_ok(proc)
    assert "nothing to train" in proc.stdout
    again = json.loads(results.read_text())
    assert again["global_step"] == 2000
    assert again["metrics"]["eval"]["accuracy"] == pytest.approx(
        first["metrics"]["eval"]["accuracy"]
    )
    assert {
        s: os.path.getmtime(model_dir / f"ckpt-{s}.index") for s in checkpoint_steps(model_dir)
    } == saved


def pointer_step(model_dir):
    """The step of the checkpoint the ``checkpoint`` pointer file names (-1: none)."""
    path = tf.train.latest_checkpoint(str(model_dir)) if model_dir.exists() else None
    return int(path.rsplit("-", 1)[1]) if path else -1


def test_killed_run_continues_from_its_last_checkpoint(tmp_path, data_dir):
    model_dir = tmp_path / "run"
    args = digits_args(
        data_dir,
        model_dir,
        "--schedule",
        "train",
        "--gin_param",
        "experiment.max_steps = 1000000",
        "--gin_param",
        "Estimator.save_checkpoints_steps = 200",
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and pointer_step(model_dir) < 400:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # The last complete checkpoint is the one the pointer names: a kill during a save
    # leaves that save's files behind with the pointer still on the previous one.
    last = pointer_step(model_dir)
    assert last >= 400
    resumed = run_cli(
        *digits_args(
            data_dir,
            model_dir,
            "--schedule",
            "train",
            "--gin_param",
            f"experiment.max_steps = {last + 100}",
        )
    )
    assert_ok(resumed)
    assert (
        f"ckpt-{last}" in resumed.stdout and f"from step {last} to {last + 100}" in resumed.stdout
    )
    assert pointer_step(model_dir) == last + 100


def test_train_then_evaluate_then_predict(tmp_path, data_dir):
    model_dir = tmp_path / "run"
    ten = ["--gin_param", "experiment.max_steps = 10"]
    assert_ok(run_cli(*digits_args(data_dir, model_dir, "--schedule", "train", *ten)))
    assert checkpoint_steps(model_dir) == [10]

    results = tmp_path / "eval.json"
    assert_ok(
        run_cli(
            *digits_args(
                data_dir, model_dir, "--schedule", "evaluate", *ten, "--results", str(results)
            )
        )
    )
    evaluated = json.loads(results.read_text())
    assert evaluated["global_step"] == 10 and 0 <= evaluated["metrics"]["eval"]["accuracy"] <= 1

    predictions = tmp_path / "predictions.jsonl"
    assert_ok(
        run_cli(
            *digits_args(
                data_dir, model_dir, "--schedule", "predict", *ten, "--results", str(predictions)
            )
        )
    )
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert len(lines) == 360
    assert 0 <= lines[0]["classes"] < 10 and len(lines[0]["probabilities"]) == 10


def test_user_model_from_own_module_through_gin_import(tmp_path):
    """A ModelFn in the user's own module, made known to gin by the file's import line."""
    env = {"PYTHONPATH": os.path.join(REPO, "tests", "user_project")}
    gin_file = os.path.join(REPO, "tests", "user_project", "polyfit.gin")
    model_dir, results = tmp_path / "poly", tmp_path / "r.json"
    proc = run_cli(
        "--gin_file", gin_file, "--model_dir", str(model_dir), "--results", str(results), env=env
    )
    assert_ok(proc)
    assert json.loads(results.read_text())["metrics"]["eval"]["abs_error"] < 0.15
    predictions = tmp_path / "p.jsonl"
    assert_ok(
        run_cli(
            "--gin_file",
            gin_file,
            "--model_dir",
            str(model_dir),
            "--schedule",
            "predict",
            "--results",
            str(predictions),
            env=env,
        )
    )
    ys = [json.loads(line)["y"][0] for line in predictions.read_text().splitlines()]
    assert ys == pytest.approx([3.0, 4.25, 8.0], abs=0.1)  # y = 5x^2 + 3 at x = 0, .5, 1


def write(path, text):
    path.write_text(text)
    return str(path)


BAD_INPUTS = {
    "missing_gin_file": (
        lambda tmp: ["--gin_file", "experiments/nope.gin"],
        "error: --gin_file=experiments/nope.gin: no such file; experiments here:",
    ),
    "unknown_configurable": (
        lambda tmp: ["--gin_file", write(tmp / "a.gin", "import models.mlp\n\nMLPP.x = 1\n")],
        "a.gin:3: No configurable matching 'MLPP'; did you mean 'MLP'?",
    ),
    "unknown_parameter": (
        lambda tmp: [
            "--gin_file",
            DIGITS,
            "--gin_file",
            write(tmp / "b.gin", "# header\nMLP.hidden_unit = [4]\n"),
        ],
        "b.gin:2: Configurable 'MLP' doesn't have a parameter named 'hidden_unit'; "
        "did you mean 'hidden_units'?",
    ),
    "unknown_parameter_in_gin_param": (
        lambda tmp: ["--gin_file", DIGITS, "--gin_param", "Estimator.save_every = 3"],
        "--gin_param: Configurable 'Estimator' doesn't have a parameter named 'save_every'",
    ),
    "gin_syntax_error": (
        lambda tmp: [
            "--gin_file",
            write(tmp / "c.gin", "import models.mlp\nMLP.hidden_units = [4\n"),
        ],
        "c.gin:2: gin syntax error: a bracket opened here is never closed",
    ),
    "missing_required_binding": (
        lambda tmp: [
            "--gin_file",
            write(tmp / "d.gin", "import models.mlp\nexperiment.model_fn = @MLP()\n"),
        ],
        "error: experiment needs values for input_fn, max_steps",
    ),
    "unwritable_model_dir": (
        lambda tmp: ["--gin_file", DIGITS, "--model_dir", write(tmp / "file", "") + "/run"],
        "is not writable (Not a directory)",
    ),
    "predict_without_results": (
        lambda tmp: ["--gin_file", DIGITS, "--schedule", "predict", "--model_dir", str(tmp)],
        "error: --schedule=predict needs --results",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_one_clear_line(tmp_path, case):
    make_args, expected = BAD_INPUTS[case]
    proc = run_cli(*make_args(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expected in last, last


def test_unknown_schedule_is_refused_by_the_flag_parser(tmp_path):
    proc = run_cli("--gin_file", DIGITS, "--model_dir", str(tmp_path), "--schedule", "fly")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert (
        "flag --schedule=fly: value should be one of "
        "<train|evaluate|train_and_evaluate|continuous_eval|predict|export>"
    ) in proc.stderr
    assert not os.listdir(tmp_path)  # nothing was written
