"""What a person sees: a bar on a terminal, plain lines otherwise, a metrics file."""

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios

import keras
import pandas
import pyte
import pytest

from datasets import digits
from models.mlp import MLP
from tests.support.commands import REPO, digits_args, run_cli
from trainer import Estimator
from trainer.settings import Checkpoints

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but tab and newline


def run_in_terminal(args, columns=120, interrupt_after=None):
    """Runs ``python -m trainer ARGS`` on a pseudo-terminal (stdin and stdout; stderr piped).

    ``interrupt_after``: type Ctrl-C once that many "Saved checkpoint" lines are out.
    Returns (exit code, the terminal's bytes as text, stderr).
    """
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        stdin=follower,
        stdout=follower,
        stderr=subprocess.PIPE,
        start_new_session=True,  # the terminal becomes its controlling one: Ctrl-C is SIGINT
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
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
            if interrupt_after and out.count(b"Saved checkpoint") == interrupt_after:
                os.write(leader, b"\x03")  # Ctrl-C, as typed: the terminal echoes ^C
                interrupt_after = None
        elif proc.poll() is not None:
            break
    os.close(leader)
    err = proc.stderr.read().decode()
    return proc.wait(timeout=60), out.decode(), err


def screen_lines(out, columns=120):
    """What a terminal ``columns`` wide shows of ``out``, scrolled-off lines included."""
    screen = pyte.HistoryScreen(columns, 40, history=10_000)
    pyte.Stream(screen).feed(out.replace("\n", "\r\n"))  # the pty's own newline handling
    rows = [*screen.history.top, *(screen.buffer[y] for y in range(screen.lines))]
    lines = ["".join(row[x].data for x in range(columns)).rstrip() for row in rows]
    return [line for line in lines if line]


@pytest.mark.slow
def test_a_terminal_shows_one_bar_with_whole_lines_above_it_and_a_clean_ctrl_c(tmp_path, data_dir):
    every = ["experiment.eval_every_steps = 250", "Checkpoints.every_steps = 250"]
    args = digits_args(data_dir, tmp_path / "run", "--gin_param", "experiment.max_steps = 2000")
    code, out, err = run_in_terminal(
        [*args, *(a for e in every for a in ("--gin_param", e))], 120, 3
    )
    assert code == 75, err[-3000:]
    assert re.fullmatch(r"preempted: SIGINT received: saved \S+/ckpt-\d+ at step \d+; .*\n", err)
    lines = screen_lines(out)
    bar = re.compile(r"^(train \d+/2000|eval 'eval' \d+/360) \|")
    logged = ("Saved checkpoint", "Evaluation of", "Training MLP", "Input:")
    for line in lines:  # each line is a bar or a message, never both, never a bar's remains
        assert not (bar.search(line) and any(m in line for m in logged)), line
        assert "ETA ?" not in line and "^C" not in line, line
        assert not any(m in line and not line.startswith(m) for m in logged), line
    assert [line for line in lines if line.startswith("Saved checkpoint")][:3] == [
        f"Saved checkpoint {tmp_path}/run/ckpt-{s}" for s in (250, 500, 750)
    ]
    assert len([line for line in lines if line.startswith("Evaluation of 'eval'")]) >= 3
    assert [line for line in lines if bar.search(line)] == [lines[-1]]  # one bar, left at the end
    moving = r"train \d+/2000 \|█+[▏▎▍▌▋▊▉]? *\| [\d.]+step/s ETA [\d:]+, loss [\d.]+"
    assert re.match(moving, lines[-1])
    assert all(len(line) <= 117 for line in lines if bar.search(line))  # room for ^C: no wrap
    # The bars drawn: training's, moving; evaluation's, counting to the real total.
    assert len(set(re.findall(r"train (\d+)/2000 \|", out))) >= 3
    assert set(re.findall(r"eval 'eval' [\d.]+/(\d+) \|", out)) == {"360"}
    assert "step 200/2000  loss" not in out  # the bar says it; the log file keeps the line
    assert "Downloading and preparing" not in out  # TFDS's, as the digits are first built


@pytest.mark.slow
def test_redirected_output_is_plain_lines_every_log_step(tmp_path, data_dir):
    proc = run_cli(
        *digits_args(data_dir, tmp_path / "run", "--gin_param", "experiment.max_steps = 300")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    problems = proc.stderr.splitlines()  # a warning (input-bound, on a loaded machine)
    assert all(line.startswith("warning: ") for line in problems), proc.stderr[-3000:]
    assert len(problems) == len(set(problems))
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
        checkpoints=Checkpoints(every_steps=None),
        seed=0,
        **kwargs,
    )


@pytest.mark.parametrize("progress", [True, False])
def test_training_from_python_shows_progress_unless_asked_not_to(
    tmp_path, data_dir, capsys, progress
):
    """From a script or notebook the CLI's lines show, and trainer.log is written."""
    input_fn = lambda mode, params: digits.input_fn(mode, params, data_dir=data_dir)  # noqa: E731
    estimator = digits_estimator(tmp_path, progress=progress)
    estimator.train_and_evaluate(input_fn, input_fn, max_steps=20)
    out, err = capsys.readouterr()
    lines = re.findall(r"^step (\d+)/20  loss .* examples/s  ETA .*$", out, re.M)
    assert lines == (["10", "20"] if progress else [])
    said = [
        f"Training MLP (1,210 parameters) from step 0 to 20 on 1 device (CPU:0) in new {tmp_path}",
        f"Saved checkpoint {tmp_path}/ckpt-20",
        "Evaluation of 'eval' at step 20 (360 examples, ",
    ]
    assert [any(line.startswith(s) for line in out.splitlines()) for s in said] == [progress] * 3
    assert err == ""
    log = tmp_path / "trainer.log"
    assert log.exists() == progress
    if progress:
        assert all(s in log.read_text() for s in said)
    estimator.evaluate(input_fn)  # a second call speaks again, the log appended to
    out = capsys.readouterr().out
    assert out.startswith("Evaluation of 'eval' at step 20") == progress


@pytest.mark.slow
def test_metrics_file_holds_each_step_once_after_a_resume(tmp_path, data_dir, forked_cli):
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
    assert forked_cli.run(*args).returncode == 0
    path = tmp_path / "run" / "metrics.jsonl"
    # As if the run had logged step 250 and died before its next checkpoint.
    with open(path, "a") as f:
        f.write(json.dumps({"step": 250, "time": 0.0, "writer": "train", "loss": 9.0}) + "\n")
    args[args.index("experiment.max_steps = 200")] = "experiment.max_steps = 300"
    assert forked_cli.run(*args).returncode == 0
    records = pandas.read_json(path, lines=True)  # the one line a user would write
    train = records[records.writer == "train"]
    assert train.step.tolist() == [50, 100, 150, 200, 250, 300]
    assert (train.loss != 9.0).all() and train.loss.notna().all()
    evals = records[records.writer == "eval_eval"]
    assert evals.step.tolist() == [100, 200, 300]
    assert (evals.accuracy > 0.5).all()


@pytest.mark.slow
def test_importing_the_framework_changes_nothing_and_a_quiet_start_is_asked_for():
    """``import trainer`` in a script or notebook imports nothing yet and, with its
    modules, changes no file descriptor, import hook, environment variable or filter of
    TensorFlow's logger beyond what TensorFlow's own import changes;
    ``trainer.quiet_start()`` before TensorFlow loads holds its start-up lines back, as
    the command line does."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    unchanged = (
        "import os, sys\n"
        "import trainer\n"
        "assert not {'tensorflow', 'keras'} & set(sys.modules), 'imported at once'\n"
        "import tensorflow, keras, tensorflow_datasets, gin, sklearn\n"  # their own changes
        "ours = lambda: [type(f).__module__ for f in sys.meta_path\n"
        "                if type(f).__module__.split('.')[0] in ('trainer', 'datasets')]\n"
        "filters = lambda: list(tensorflow.get_logger().filters)\n"
        "seen = lambda: (ours(), os.fstat(2).st_ino, dict(os.environ), filters())\n"
        "before = seen()\n"
        "import trainer.estimator, trainer.cli.experiment, datasets.pipeline, datasets.digits\n"
        "import trainer.checkpoint_writer\n"
        "trainer.Estimator, trainer.ModelFn\n"
        "print(seen() == before == ([], before[1], before[2], before[3]))\n"
    )
    quiet = (
        "import trainer\n"
        "trainer.quiet_start()\n"
        "import trainer.estimator, datasets.pipeline, keras, tensorflow\n"
    )
    for code, out in ((unchanged, "True\n"), (quiet, "")):
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == out, proc.stdout
        if code is quiet:
            problems = proc.stderr.splitlines()  # a warning (input-bound, on a loaded machine)
    assert all(line.startswith("warning: ") for line in problems), proc.stderr[-3000:]
    assert len(problems) == len(set(problems))


@pytest.mark.parametrize("ending", ["abort", "import_error"])
def test_a_tensorflow_that_fails_while_loading_has_its_lines_said(tmp_path, ending):
    """quiet_start holds TensorFlow's start-up lines back; a TensorFlow that aborts (a CPU
    it was not built for) or fails to import still has what it wrote said, noise aside."""
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    end = "os.abort()" if ending == "abort" else "raise ImportError('no libcudart.so.12')"
    (fake / "__init__.py").write_text(
        "import os\n"
        "os.write(2, b'I0000 cpu_feature_guard.cc:227] This TensorFlow binary is optimized\\n')\n"
        "os.write(2, b'F0000 port.cc:42] Check failed: AVX512F not supported\\n')\n"
        f"{end}\n"
    )
    code = "from trainer import console\nconsole.quiet_start(command_line=True)\n"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == (-signal.SIGABRT if ending == "abort" else 1), proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "F0000 port.cc:42] Check failed: AVX512F not supported", proc.stderr
    if ending == "import_error":
        assert lines[-1] == "ImportError: no libcudart.so.12"


SCRIPT = """
import trainer

trainer.quiet_start()  # before TensorFlow: its start-up lines held back

import keras
import numpy as np
import tensorflow as tf

x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int64")


def input_fn(mode, params):
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if mode == trainer.Mode.TRAIN:
        dataset = dataset.repeat()
    return dataset.batch(params.batch_size)


model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
estimator = trainer.Estimator(model, "output/script", global_batch_size=8, log_every_steps=2)
estimator.train_and_evaluate(input_fn, input_fn, max_steps=4)
"""


@pytest.mark.slow
def test_a_python_script_shows_each_line_once_and_no_tensorflow_internals(tmp_path):
    """``python3 my_script.py`` using the API as the guides show it: the command line's
    lines, each once, on stdout; nothing on stderr (absl's ``INFO:absl:`` copies,
    TensorFlow's "Sharding callback duration")."""
    (tmp_path / "my_script.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    proc = subprocess.run(
        [sys.executable, "my_script.py"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    problems = proc.stderr.splitlines()  # a warning (input-bound, on a loaded machine)
    assert all(line.startswith("warning: ") for line in problems), proc.stderr[-3000:]
    assert len(problems) == len(set(problems))
    lines = proc.stdout.splitlines()
    assert len(lines) == len(set(lines)), proc.stdout
    assert lines[0].startswith("Training Keras model 'sequential' (10 parameters) from step 0")
    assert sum(line.startswith(("step 2/4", "step 4/4")) for line in lines) == 2
    assert "Saved checkpoint output/script/ckpt-4" in lines
