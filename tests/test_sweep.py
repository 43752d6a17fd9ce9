"""``--sweep`` as a user runs it: a grid of trials from one command, stopped and rerun."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from tests.support.commands import ENV, REPO, digits_args, run_cli
from tests.support.helpers import checkpoint_steps, dir_hash
from trainer.cli import sweep
from trainer.errors import UserError

FORTY_STEPS = [
    *("--gin_param", "experiment.max_steps = 40"),
    *("--gin_param", "Checkpoints.every_steps = 10"),
    *("--gin_param", "Estimator.log_every_steps = 10"),
]
GRID = [
    *("--sweep", "Adam.learning_rate = [1e-3, 3e-3, 1e-2]"),
    *("--sweep", "faulty_digits.fault = [None, 'slow']"),  # 'slow': 50 ms a batch
]


@pytest.mark.slow
def test_a_sweep_stopped_and_rerun_trains_each_trial_once(tmp_path, faulty_gin):
    sweep_dir, results = tmp_path / "sweep", tmp_path / "sweep.json"
    args = ["--gin_file", faulty_gin, "--model_dir", str(sweep_dir), *FORTY_STEPS, *GRID]
    args += ["--results", str(results)]
    first, second = (
        sweep_dir / "learning_rate=1e-3,fault=None",
        sweep_dir / "learning_rate=1e-3,fault=slow",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not (second.exists() and checkpoint_steps(second)) and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the second trial is training: it saves, the sweep ends
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-3000:]
    stopped_at = checkpoint_steps(second)[-1]
    assert 10 <= stopped_at < 40
    assert err.strip().splitlines()[-1] == (
        f"preempted: SIGTERM received: saved {second}/ckpt-{stopped_at} at step {stopped_at}; "
        "rerun the same command to resume"
    )
    assert (first / sweep.TRIAL_FILE).exists() and not (second / sweep.TRIAL_FILE).exists()
    finished = dir_hash(first)

    rerun = run_cli(*args, env=ENV)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"trial 1 of 6: {first.name}: finished before ({first}), not run again" in rerun.stdout
    assert f"from step {stopped_at} to 40" in rerun.stdout  # the stopped trial resumed
    assert rerun.stdout.count("from step 0 to 40") == 4  # the four never started
    assert dir_hash(first) == finished  # the finished trial untouched
    assert "retracing" not in rerun.stdout + rerun.stderr  # six Estimators in two processes

    # The table: every trial, best eval loss first; the same in --results.
    table = rerun.stdout.split("sweep: 6 trials in ")[1].splitlines()
    assert table[0] == f"{sweep_dir}, best first by loss on 'eval'"
    assert table[1].split() == ["trial", "step", "loss", "accuracy", "best", "loss", "at", "step"]
    recorded = json.loads(results.read_text())
    assert recorded["metric"] == "loss" and recorded["higher"] is False
    names = [trial["trial"] for trial in recorded["trials"]]
    assert [line.split()[0] for line in table[2:8]] == names
    assert sorted(names) == sorted(path.name for path in sweep_dir.iterdir())
    losses = [trial["history"][-1]["loss"] for trial in recorded["trials"]]
    assert losses == sorted(losses) and all(t["global_step"] == 40 for t in recorded["trials"])

    # A trial in the sweep's process trains as the same run on its own does.
    alone = tmp_path / "alone"
    bindings = ["Adam.learning_rate = 1e-2", "faulty_digits.fault = None"]
    single = ["--gin_file", faulty_gin, "--model_dir", str(alone), *FORTY_STEPS]
    single += [arg for binding in bindings for arg in ("--gin_param", binding)]
    assert run_cli(*single, "--results", str(tmp_path / "alone.json"), env=ENV).returncode == 0
    trial = next(t for t in recorded["trials"] if t["trial"] == "learning_rate=1e-2,fault=None")
    alone_loss = json.loads((tmp_path / "alone.json").read_text())["metrics"]["eval"]["loss"]
    assert trial["metrics"]["eval"]["loss"] == pytest.approx(alone_loss, rel=1e-6)

    # TensorBoard's HParams tab: each trial is one session with its own values.
    session = event_accumulator.EventAccumulator(str(sweep_dir / trial["trial"]))
    session.Reload()
    start = session.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    values = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert values["Adam.learning_rate"].number_value == pytest.approx(1e-2)


@pytest.mark.parametrize(
    "sweeps, message",
    [
        (["Adam.learning_rate = []"], "--sweep Adam.learning_rate = []: the list is empty"),
        (
            ["Adam.learning_rate = 1e-3"],
            "--sweep Adam.learning_rate = 1e-3: give its values as a list",
        ),
        (["learning_rate = [1e-3]"], "--sweep 'learning_rate = [1e-3]': give one binding"),
        (["Adam.learning_rate = [1e-3, )]"], "its brackets or quotes do not match"),
        (["MLP.hidden_units = [[64], [32]"], "its brackets or quotes do not match"),
        (["MLP.hidden_units = [[64]] [32]"], "its brackets or quotes do not match"),
        (["Adam.beta_1 = [0.9]", "Adam.beta_1 = [0.5]"], "--sweep Adam.beta_1 is given twice"),
    ],
)
def test_a_grid_that_cannot_be_read_is_refused(sweeps, message):
    with pytest.raises(UserError) as raised:
        sweep.grid(sweeps)
    assert message in str(raised.value)


def test_a_grid_is_every_combination_named_by_its_values():
    trials = sweep.grid(
        [
            "MLP.hidden_units = [[64], [32, 32]]",
            "Adam.learning_rate = [1e-3, 1e-2]",
            "optimizers.Adam.epsilon = [1e-7]",
            "scope/Adam.epsilon = [@eps(), '/tmp/x y']",
        ]
    )
    assert [t.name for t in trials[:2]] == [
        "hidden_units=[64],learning_rate=1e-3,optimizers.Adam.epsilon=1e-7,scope_Adam.epsilon=@eps()",
        "hidden_units=[64],learning_rate=1e-3,optimizers.Adam.epsilon=1e-7,scope_Adam.epsilon=_tmp_xy",
    ]
    assert len(trials) == 8
    assert trials[-1].params == [
        "MLP.hidden_units = [32, 32]",
        "Adam.learning_rate = 1e-2",
        "optimizers.Adam.epsilon = 1e-7",
        "scope/Adam.epsilon = '/tmp/x y'",
    ]


@pytest.mark.slow
def test_a_sweep_of_the_devices_runs_each_trial_as_a_command_of_its_own(tmp_path, data_dir):
    sweep_dir = tmp_path / "devices"
    args = digits_args(data_dir, sweep_dir, "--gin_file", "experiments/smoke.gin")
    proc = run_cli(*args, "--sweep", "Devices.count = [1, 2]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " on 1 device (CPU:0) " in proc.stdout  # a process splits its CPU once
    assert " on 2 devices (CPU:0, CPU:1), towers " in proc.stdout
    for name in ("count=1", "count=2"):
        record = json.loads((sweep_dir / name / sweep.TRIAL_FILE).read_text())
        assert record["trial"] == name and record["global_step"] == 10
        assert record["bindings"] == {"Devices.count": name[-1]}
    assert proc.stdout.split("sweep: 2 trials in ")[1].count("count=") == 2
