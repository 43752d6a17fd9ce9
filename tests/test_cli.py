"""``python -m trainer`` as a user runs it: subprocesses, real files, exit codes, messages."""

import json
import re
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

from tests.support.commands import REPO, digits_args, run_cli
from tests.support.helpers import checkpoint_steps

DIGITS = "experiments/digits_mlp.gin"


def assert_ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_train_then_evaluate_then_predict(tmp_path, data_dir):
    model_dir = tmp_path / "run"
    ten = ["--gin_param", "experiment.max_steps = 10"]
    assert_ok(run_cli(*digits_args(data_dir, model_dir, "--schedule", "train_and_evaluate", *ten)))
    assert checkpoint_steps(model_dir) == [10]
    # TensorBoard's HParams tab: model_dir is one session, its bindings the hyperparameters
    # (not where or how long it runs), train/ and eval_eval/ its metric groups.
    session = event_accumulator.EventAccumulator(str(model_dir))
    session.Reload()
    content = session.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    values = start.session_start_info.hparams
    assert values["Adam.learning_rate"].number_value == pytest.approx(1e-3)
    assert values["MLP.hidden_units"].string_value == "[256, 256]"
    assert values["experiment.model_fn"].string_value == "@MLP()"
    assert not [k for k in values if k.endswith(("max_steps", "data_dir", "steps_per_loop"))]
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"])
    assert end.session_end_info.status == api_pb2.STATUS_SUCCESS
    for group in ("train", "eval_eval"):
        scalars = event_accumulator.EventAccumulator(str(model_dir / group))
        scalars.Reload()
        assert {"loss", "accuracy"} <= set(scalars.PluginTagToContent("scalars")), group

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


def test_help_lists_the_trainers_own_flags_and_exits_0():
    proc = run_cli("--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: python3 -m trainer --gin_file")
    flags = [line.split(":")[0].strip() for line in lines if line.startswith("  --")]
    assert flags == [
        "--gin_file",
        "--gin_param",
        "--model_dir",
        "--schedule",
        "--results",
        "--checkpoint",
        "--profile_steps",
        "--run_eagerly",
        "--overwrite_config",
        "--num_devices",
        "--tracking_uri",
        "--export_format",
        "--sweep",
        "--workers",
    ]
    assert "schedules: train, evaluate, train_and_evaluate" in proc.stdout
    assert len(lines) < 33  # TensorFlow's and absl's flags stay in --helpfull


@pytest.mark.parametrize(
    "args, out",
    [
        (["--help"], r"usage: python3 -m trainer .*"),
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
        (  # gin's syntax too: its parser is read with every name taken as known
            ["--gin_file=experiments/digits_mlp.gin", "--gin_param", "experiment.max_steps:9"],
            r"error: --gin_param:1: gin syntax error: a binding is 'name = value': write "
            r"'experiment\.max_steps = 9'",
        ),
        (
            ["--gin_file=experiments/digits_mlp.gin", "--export_format", "onnx"],
            r"error: --export_format applies to --schedule export; .*",
        ),
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
    assert not {"tensorflow", "keras"} & imported
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "import time:" not in line]
    assert re.fullmatch(out, said[0]), said
    assert proc.returncode == (0 if args == ["--help"] else 2)


def test_flag_mistakes_exit_with_the_user_error_code():
    import inspect

    from trainer import UserError, exit_codes

    default = inspect.signature(exit_codes.fail).parameters["exit_code"].default
    assert default == exit_codes.USER_ERROR == UserError.exit_code == 2


@pytest.mark.slow
def test_a_batch_larger_than_the_training_set_is_warned_of_once(tmp_path, data_dir):
    args = [
        "--gin_param",
        "experiment.max_steps = 3",
        "--gin_param",
        "Estimator.steps_per_loop = 1",
    ]
    args += ["--gin_param", "Estimator.global_batch_size = 5000"]
    proc = run_cli(*digits_args(data_dir, tmp_path / "run", *args))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [line for line in proc.stderr.splitlines() if "larger than" in line]
    assert warned == [
        "warning: a batch of 5,000 examples is larger than the training data (1,437 examples "
        "in 'train'): each step repeats examples, and an epoch is less than a step; lower "
        "Estimator.global_batch_size"
    ]  # once; a loaded machine may add that training waited for input
