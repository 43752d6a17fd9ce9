"""``python -m trainer`` as a user runs it: subprocesses, real files, exit codes, messages."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, digits_args, run_cli
from tests.helpers import checkpoint_steps, event_tags

DIGITS = "experiments/digits_mlp.gin"


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_default_experiment_reaches_accuracy_then_resumes(tmp_path, data_dir):
    """The README's first command: >= 0.95 eval accuracy; a rerun trains nothing."""
    model_dir, results = tmp_path / "run", tmp_path / "results.json"
    # As a user runs it: TF_CPP_MIN_LOG_LEVEL unset.
    proc = run_cli(
        *digits_args(data_dir, model_dir, "--results", str(results)),
        unset=["TF_CPP_MIN_LOG_LEVEL"],
    )
    assert_ok(proc)
    assert proc.stderr == ""  # no warning either: the digits in memory are not input-bound
    assert re.search(rf"^model_dir +{re.escape(str(model_dir))}$", proc.stdout, re.M)
    assert re.search(r"^eval +[\d.]+ +0\.9\d+$", proc.stdout, re.M)  # loss, accuracy
    assert f"tensorboard  tensorboard --logdir {model_dir}" in proc.stdout
    # README's captured console is this run's, line for line up to the numbers.
    shape = lambda text: [re.sub(r"\d+(\.\d+)?", "N", line) for line in text.splitlines()]  # noqa: E731
    with open(os.path.join(REPO, "README.md")) as f:
        shown = re.search(r"```console\n(.*?)```", f.read(), re.S).group(1)
    printed = proc.stdout.replace(str(model_dir), "output/digits_mlp")
    printed = re.sub(r"^results .*\n", "", printed, flags=re.M)  # README's has no --results
    assert shape(shown) == shape(printed)
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


def test_help_lists_the_trainers_own_flags_and_exits_0():
    proc = run_cli("--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: python -m trainer --gin_file")
    flags = [line.split(":")[0].strip() for line in lines if line.startswith("  --")]
    assert flags == [
        "--gin_file",
        "--gin_param",
        "--model_dir",
        "--schedule",
        "--results",
        "--profile_steps",
        "--run_eagerly",
        "--overwrite_config",
        "--num_devices",
    ]
    assert "schedules: train, evaluate, train_and_evaluate" in proc.stdout
    assert len(lines) < 30  # TensorFlow's and absl's flags stay in --helpfull


@pytest.mark.parametrize(
    "args, out",
    [
        (["--help"], r"usage: python -m trainer .*"),
        (
            ["--max_stepz=5"],
            r"error: unknown flag --max_stepz; did you mean the gin setting "
            r"--gin_param 'experiment\.max_steps = 5'\?",
        ),
        (["--max_steps=5"], r"error: unknown flag --max_steps: it is a gin setting, .*"),
        (["--schedule", "fly"], r"error: flag --schedule=fly: value should be one of .*"),
        (["extra"], r"error: unexpected arguments \['extra'\]: every option is a --flag .*"),
        ([], r"error: --gin_file is required, e\.g\. --gin_file=experiments/digits_mlp\.gin"),
        (["--gin_file=nope.gin"], r"error: --gin_file=nope\.gin: no such file; experiments .*"),
    ],
)
def test_help_and_flag_mistakes_answer_before_tensorflow_loads(args, out):
    """-X importtime lists every module the command imported: TensorFlow is not one."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "trainer", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert {"absl.app", "absl.flags"} <= imported  # the list is read right
    assert not {"tensorflow", "keras", "gin"} & imported
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "import time:" not in line]
    assert re.fullmatch(out, said[0]), said
    assert proc.returncode == (0 if args == ["--help"] else 2)


def test_flag_mistakes_exit_with_the_user_error_code():
    from trainer import UserError, command

    assert command.EXIT_USER_ERROR == UserError.exit_code == 2
