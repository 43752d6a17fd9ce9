"""What a person sees: a bar on a terminal, plain lines otherwise, a metrics file."""

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import keras
import pandas
import pytest

from datasets import digits
from models.mlp import MLP
from tests.conftest import REPO, digits_args, run_cli
from trainer import Estimator

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but tab and newline


def run_in_terminal(args, columns=120):
    """Runs ``python -m trainer ARGS`` with stdout on a pseudo-terminal; (code, out, err)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        stdout=follower,
        stderr=subprocess.PIPE,
        text=False,
    )
    os.close(follower)
    out = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), out.decode(), err


def test_a_terminal_gets_a_live_bar_that_ends_at_max_steps(tmp_path, data_dir):
    code, out, err = run_in_terminal(
        digits_args(data_dir, tmp_path / "run", "--gin_param", "experiment.max_steps = 300")
    )
    assert code == 0, err[-3000:]
    assert err == ""
    frames = re.findall(r"\rtrain (\d+)/300 \|", out)
    assert frames[0] == "0" and frames[-1] == "300" and len(set(frames)) >= 3
    assert re.search(r"\rtrain 300/300 \|█+\| [\d.]+step/s ETA 00:00, loss [\d.]+  accuracy", out)
    assert "step 200/300  loss" not in out  # the bar says it; the log file keeps the line
    assert re.search(r"\reval 'eval' 360/360 \|█+\|", out)  # an evaluation has one too
    # Lines logged during training are written above the bar, each whole.
    assert re.search(r"(\r\n|\r\s*\r)Saved checkpoint \S+/ckpt-300\r\n", out)
    assert "Downloading and preparing" not in out  # TFDS's, as the digits are first built


def test_redirected_output_is_plain_lines_every_log_step(tmp_path, data_dir):
    proc = run_cli(
        *digits_args(data_dir, tmp_path / "run", "--gin_param", "experiment.max_steps = 300")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    assert not CONTROL.search(proc.stdout), repr(proc.stdout[:2000])
    assert re.search(
        r"^step 300/300  loss [\d.]+  accuracy [\d.]+  .* examples/s  ETA 0:00:00$",
        proc.stdout,
        re.M,
    )
    # The time split names where the time went; the parts add up to the wall time.
    reached = re.search(r"^step 300 reached in ([\d.]+)s \((.*)\)$", proc.stdout, re.M)
    parts = dict(part.rsplit(" ", 1) for part in reached.group(2).split(", "))
    for part in ("imports", "input", "building", "training", "checkpoints", "evaluation"):
        assert part in parts, parts
    seconds = sum(float(value.rstrip("s")) for value in parts.values())
    assert seconds == pytest.approx(float(reached.group(1)), abs=0.1 * len(parts))


def digits_estimator(model_dir, **kwargs):
    keras.utils.set_random_seed(0)
    return Estimator(
        MLP(hidden_units=[16]),
        str(model_dir),
        global_batch_size=32,
        steps_per_loop=10,
        log_every_steps=10,
        save_checkpoints_steps=None,
        seed=0,
        **kwargs,
    )


@pytest.mark.parametrize("progress", [True, False])
def test_training_from_python_shows_progress_unless_asked_not_to(
    tmp_path, data_dir, capsys, progress
):
    input_fn = lambda mode, params: digits.input_fn(mode, params, data_dir=data_dir)  # noqa: E731
    digits_estimator(tmp_path, progress=progress).train(input_fn, max_steps=20)
    out = capsys.readouterr().out
    lines = re.findall(r"^step (\d+)/20  loss .* examples/s  ETA .*$", out, re.M)
    assert lines == (["10", "20"] if progress else [])


def test_metrics_file_holds_each_step_once_after_a_resume(tmp_path, data_dir):
    args = digits_args(
        data_dir,
        tmp_path / "run",
        "--gin_param",
        "experiment.max_steps = 200",
        "--gin_param",
        "Estimator.log_every_steps = 50",
        "--gin_param",
        "experiment.eval_every_steps = 100",
    )
    assert run_cli(*args).returncode == 0
    path = tmp_path / "run" / "metrics.jsonl"
    # As if the run had logged step 250 and died before its next checkpoint.
    with open(path, "a") as f:
        f.write(json.dumps({"step": 250, "time": 0.0, "writer": "train", "loss": 9.0}) + "\n")
    args[args.index("experiment.max_steps = 200")] = "experiment.max_steps = 300"
    assert run_cli(*args).returncode == 0
    records = pandas.read_json(path, lines=True)  # the one line a user would write
    train = records[records.writer == "train"]
    assert train.step.tolist() == [50, 100, 150, 200, 250, 300]
    assert (train.loss != 9.0).all() and train.loss.notna().all()
    evals = records[records.writer == "eval_eval"]
    assert evals.step.tolist() == [100, 200, 300]
    assert (evals.accuracy > 0.5).all()
