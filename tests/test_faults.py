"""Faults and bad input, through subprocesses of ``python -m trainer``.

Each bad-input test runs against a copy of a trained model_dir and checks three
things: the exit code, the one-line message, and that the previous checkpoint is
untouched and still restores.
"""

import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets import digits
from datasets.records import shards
from tests.support.commands import ENV, REPO, digits_args, run_cli
from tests.support.helpers import (
    STATE_PREFIXES,
    checkpoint_steps,
    dir_hash,
    saved_state,
    start,
    wait_for_checkpoint_after,
)
from trainer import Estimator, ModelFn, Spec, UserError
from trainer.distributed import preemption
from trainer.errors import TrainingDiverged
from trainer.settings import Checkpoints, Devices, Optimization


def snapshot(model_dir):
    """The checkpoint pointer, the checkpoint files and every saved model/optimizer value."""
    latest = tf.train.latest_checkpoint(str(model_dir))
    reader = tf.train.load_checkpoint(latest)
    values = {
        key: reader.get_tensor(key)
        for key in reader.get_variable_to_shape_map()
        if key.startswith(STATE_PREFIXES)
    }
    files = sorted(f for f in os.listdir(model_dir) if f.startswith("ckpt"))
    return (model_dir / "checkpoint").read_text(), files, values


def assert_same_snapshot(before, after):
    assert before[0] == after[0] and before[1] == after[1]
    assert before[2].keys() == after[2].keys() and len(before[2]) > 4
    for key, value in before[2].items():
        np.testing.assert_array_equal(value, after[2][key], err_msg=key)


def last_line(proc):
    return proc.stderr.strip().splitlines()[-1]


def run_bad(model_dir, faulty_gin, *args, exit_code=2, **kwargs):
    before = snapshot(model_dir)
    proc = run_cli(
        "--gin_file", faulty_gin, "--model_dir", str(model_dir), *args, env=ENV, **kwargs
    )
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert_same_snapshot(before, snapshot(model_dir))
    return last_line(proc)


# ---------------------------------------------------------------- the bad-input table


@pytest.mark.slow
def test_disk_full_during_save_keeps_the_previous_checkpoint(model_dir, faulty_gin):
    data_file = model_dir / "ckpt-100.data-00000-of-00001"
    limit = os.path.getsize(data_file) // 2

    def small_disk():  # writes past `limit` bytes fail with EFBIG, like a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    before = snapshot(model_dir)
    args = [
        "--gin_file",
        faulty_gin,
        "--model_dir",
        str(model_dir),
        "--gin_param",
        "experiment.max_steps = 200",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **ENV),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=small_disk,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = last_line(proc)
    assert line.startswith(f"error: could not write checkpoint ckpt-150 in {model_dir} (")
    assert line.endswith(f"The newest complete checkpoint is still {model_dir}/ckpt-100")
    assert_same_snapshot(before, snapshot(model_dir))  # no partial ckpt-150 files either


# ---------------------------------------------------------------- NaN guard


@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_the_last_checkpoint(model_dir, faulty_gin):
    line = run_bad(
        model_dir,
        faulty_gin,
        "--gin_param",
        "faulty_digits.fault = 'nan'",
        "--gin_param",
        "experiment.max_steps = 200",
        "--overwrite_config",
        exit_code=3,
    )
    # ReLU zeroes some non-finite activations, so the gradients may go bad a step later.
    assert re.match(
        r"error: loss or gradients NaN or Inf at step 1[0-4]\d; the last good checkpoint, "
        + re.escape(f"{model_dir}/ckpt-100, is untouched"),
        line,
    ), line


@pytest.mark.slow
def test_rollback_skips_the_bad_batch_and_finishes(tmp_path, faulty_gin):
    model_dir = tmp_path / "run"
    proc = run_cli(
        "--gin_file",
        faulty_gin,
        "--model_dir",
        str(model_dir),
        "--gin_param",
        "faulty_digits.fault = 'nan_once'",
        "--gin_param",
        "faulty_digits.at_batch = 30",
        "--gin_param",
        "Checkpoints.every_steps = 20",
        "--gin_param",
        "Optimization.nonfinite_loss = 'rollback'",
        "--gin_param",
        "experiment.max_steps = 60",
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"Loss or gradients NaN or Inf at step 31: rolled back to {model_dir}/ckpt-20"
        in proc.stderr
    )
    assert "Skipping the batch of step 31" in proc.stderr
    assert checkpoint_steps(model_dir)[-1] == 60
    reader = tf.train.load_checkpoint(str(model_dir / "ckpt-60"))
    for key in reader.get_variable_to_shape_map():
        if key.startswith("model/"):
            assert np.all(np.isfinite(reader.get_tensor(key))), key


class SilentNaN(ModelFn):
    """loss = mean(|w x|) written as sqrt((w x)^2): at x = 0 the loss is 0 but the
    gradient is NaN (0 * Inf), so only the weights show the fault, a step later."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")

    def __call__(self, features, labels, mode):
        y = self.dense(features["x"])[:, 0]
        return Spec({"y": y}, loss=None if labels is None else tf.reduce_mean(tf.sqrt(y * y)))


def zero_at(index):
    """Batches of x = 1, except x = 0 in batch ``index`` (step index + 1)."""

    def input_fn(mode, params):
        def batch(i):
            x = tf.fill([params.batch_size, 1], tf.cast(i != index, tf.float32))
            return {"x": x}, {"y": tf.zeros([params.batch_size])}

        return tf.data.Dataset.range(10**9).map(batch)

    return input_fn


def silent_nan_estimator(model_dir, jit, **kwargs):
    return Estimator(
        SilentNaN(),
        str(model_dir),
        optimizer=keras.optimizers.SGD(0.001),
        global_batch_size=4,
        steps_per_loop=10,
        checkpoints=Checkpoints(every_steps=10),
        devices=Devices(jit_compile=jit),
        **kwargs,
    )


@pytest.mark.parametrize("jit", [False, True])
def test_a_nan_gradient_under_a_finite_loss_is_found_and_skipped(tmp_path, jit, caplog):
    """Step 15's gradient is NaN, its loss 0: the block 11-20 is rerun one step at a
    time from ckpt-10, step 15 is found, rolled back and its batch skipped."""
    estimator = silent_nan_estimator(
        tmp_path, jit, optimization=Optimization(nonfinite_loss="rollback")
    )
    with caplog.at_level("WARNING"):
        assert estimator.train(zero_at(14), max_steps=30) == 30
    messages = caplog.text
    assert f"in steps 11-16: rerunning them one at a time from {tmp_path}/ckpt-10" in messages
    assert f"NaN or Inf at step 15: rolled back to {tmp_path}/ckpt-10" in messages
    assert "Skipping the batch of step 15" in messages
    # Every step but the skipped batch moved w by -lr (the gradient of |w x| is 1).
    kernel = float(estimator.model_fn.dense.kernel.numpy()[0, 0])
    assert kernel == pytest.approx(1.0 - 30 * 0.001, abs=1e-6)
    assert checkpoint_steps(tmp_path) == [10, 20, 30]


def test_a_nan_gradient_stops_at_its_step_or_names_the_block(tmp_path):
    estimator = silent_nan_estimator(tmp_path / "ckpt", jit=False)
    with pytest.raises(
        TrainingDiverged, match=r"at step 15; the last good checkpoint, .*ckpt-10, is"
    ):
        estimator.train(zero_at(14), max_steps=30)
    assert checkpoint_steps(tmp_path / "ckpt") == [10]
    # Without a checkpoint to rerun from, only the block is known.
    estimator = silent_nan_estimator(tmp_path / "none", jit=False)
    with pytest.raises(TrainingDiverged, match="NaN or Inf in steps 1-6; no checkpoint yet"):
        estimator.train(zero_at(4), max_steps=30)
    # The weights in memory are NaN: inference restores the checkpoint, and there is none.
    with pytest.raises(UserError, match="no checkpoint in"):
        estimator.evaluate(zero_at(-1), steps=1)


# ---------------------------------------------------------------- kills and signals


@pytest.mark.slow
def test_sigkill_during_a_background_save_resumes_bitwise_exact(tmp_path, data_dir):
    """Killed while a save is written in the background (its files half there): the
    list still names the checkpoint before, and the rerun ends as an unbroken run."""
    args = ["--gin_file", "experiments/digits_mlp.gin", "--schedule", "train"]
    for binding in (
        f"digits.input_fn.data_dir = '{data_dir}'",
        "MLP.hidden_units = [2048, 2048]",  # a 52 MB checkpoint: its write takes a while
        "experiment.deterministic = True",
        "experiment.max_steps = 60",
        "Checkpoints.every_steps = 20",  # the first save waits, the next do not
        "Estimator.steps_per_loop = 20",
    ):
        args += ["--gin_param", binding]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run_cli(*args, "--model_dir", str(straight)).returncode == 0
    proc = start([*args, "--model_dir", str(killed)])
    try:
        deadline = time.time() + 120
        # ckpt-20 waits (listed before training goes on); ckpt-40 is the background one.
        # (ckpt-20_temp alone would not do: it outlives ckpt-20.index for a moment,
        # before the list names ckpt-20.)
        while not list(killed.glob("ckpt-40_temp")) or checkpoint_steps(killed) != [20]:
            assert proc.poll() is None and time.time() < deadline, "no background save seen"
            time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert tf.train.latest_checkpoint(str(killed)).endswith("ckpt-20")  # the one before
    resumed = run_cli(*args, "--model_dir", str(killed))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from step 20 to 60" in resumed.stdout
    expected, actual = saved_state(straight), saved_state(killed)
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(value, actual[key], err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["digits_mlp", "digits_mlp_tfrecord"])
def test_sigkill_at_random_steps_then_resume_is_bitwise_exact(tmp_path, data_dir, experiment):
    """Two kills at random moments (mid-save included); the end equals an unbroken run.

    Both experiments read their training data by index (in memory, or TFRecord shards
    by offset): a checkpoint holds only how far the stream was read. The TFRecord one
    also mixes its batches (MixUp and CutMix), drawn from the same positions.
    """
    shard_dir = tmp_path / "shard_dir"
    if experiment == "digits_mlp_tfrecord":
        for split in ("train", "test"):
            rows = list(digits.load(split, data_dir).as_numpy_iterator())
            shards.write(rows, str(shard_dir), split, 4, "png", num_classes=10)
    max_steps = 1000  # both kills come a checkpoint or two after the first (step 100)
    common = [
        "--gin_file",
        f"experiments/{experiment}.gin",
        "--schedule",
        "train",
        "--gin_param",
        f"digits.input_fn.data_dir = '{data_dir}'",
        *(
            [
                "--gin_param",
                f"tfrecord.input_fn.data_dir = '{shard_dir}'",
                # MixUp and CutMix draw from (seed, position): the resume stays exact.
                "--gin_param",
                "mixing.mixup_alpha = 0.2",
                "--gin_param",
                "mixing.cutmix_alpha = 1.0",
                "--gin_param",
                "mixing.num_classes = 10",
            ]
            if experiment == "digits_mlp_tfrecord"
            else []
        ),
        "--gin_param",
        "experiment.deterministic = True",
        "--gin_param",
        f"experiment.max_steps = {max_steps}",
        "--gin_param",
        "Checkpoints.every_steps = 100",
        "--gin_param",
        "Estimator.steps_per_loop = 20",
    ]
    straight = tmp_path / "straight"
    assert run_cli(*common, "--model_dir", str(straight)).returncode == 0

    killed = tmp_path / "killed"
    seed = int(time.time())
    rng = random.Random(seed)
    reached = 0
    for _ in range(2):
        proc = start([*common, "--model_dir", str(killed)])
        try:
            reached = wait_for_checkpoint_after(killed, reached, proc)
            time.sleep(rng.uniform(0.0, 0.6))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        # The pointer always names a complete checkpoint, even after a kill mid-save.
        assert saved_state(killed), f"seed {seed}"
        reached = checkpoint_steps(killed)[-1]
        assert reached < max_steps, f"seed {seed}: the run finished before it was killed"
    # The resumed run starts from the checkpoint the pointer names, and says so.
    last = int(tf.train.latest_checkpoint(str(killed)).rsplit("-", 1)[1])
    resumed = run_cli(*common, "--model_dir", str(killed))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from step {last} to {max_steps}" in resumed.stdout, f"seed {seed}"

    expected, actual = saved_state(straight), saved_state(killed)
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(value, actual[key], err_msg=f"{key} (seed {seed})")
    assert not any(key.startswith("input/") for key in actual)  # no iterator was saved


@pytest.mark.slow
def test_one_trainer_per_model_dir_and_a_dead_holder_is_taken_over(tmp_path, data_dir):
    """Two trainers started together: one trains, the other is refused naming it; once
    the holder is SIGKILLed a rerun takes the lock over and resumes."""
    model_dir = tmp_path / "run"
    args = digits_args(
        data_dir,
        model_dir,
        "--schedule",
        "train",
        "--gin_param",
        "experiment.max_steps = 1000000",
        "--gin_param",
        "Checkpoints.every_steps = 200",
    )
    first, second = start(args), start(args)
    try:
        refused = None
        deadline = time.time() + 120
        while refused is None and time.time() < deadline:
            refused = next((p for p in (first, second) if p.poll() is not None), None)
            time.sleep(0.05)
        holder = second if refused is first else first
        _, stderr = refused.communicate(timeout=10)
        assert refused.returncode == 2, stderr[-2000:]
        assert re.fullmatch(
            rf"error: {model_dir} is being trained by \S+ pid {holder.pid}: one trainer per "
            r"model_dir; wait for it or stop it, or train in another --model_dir",
            stderr.strip().splitlines()[-1],
        ), stderr[-2000:]
        wait_for_checkpoint_after(model_dir, 0, holder)
    finally:
        for proc in (first, second):
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    reached = checkpoint_steps(model_dir)[-1]
    args[args.index("experiment.max_steps = 1000000")] = f"experiment.max_steps = {reached + 10}"
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert re.search(rf"Took over \S+ from \S+ pid {holder.pid}, which is no longer", rerun.stderr)
    assert re.search(rf"from step {reached} to {reached + 10}", rerun.stdout)
    assert (model_dir / ".trainer.lock").read_text() == ""  # released at the end


@pytest.mark.slow
def test_sigterm_saves_at_a_step_boundary_and_exits_75(tmp_path, data_dir):
    model_dir = tmp_path / "run"
    args = [
        "--gin_file",
        "experiments/digits_mlp.gin",
        "--schedule",
        "train",
        "--model_dir",
        str(model_dir),
        "--gin_param",
        f"digits.input_fn.data_dir = '{data_dir}'",
        "--gin_param",
        "experiment.max_steps = 1000000",
        "--gin_param",
        "Checkpoints.every_steps = 1000",
        "--gin_param",
        "Estimator.steps_per_loop = 7",
    ]
    proc = start(args)
    try:
        wait_for_checkpoint_after(model_dir, 0, proc)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, stderr[-3000:]
    saved = checkpoint_steps(model_dir)[-1]
    assert saved >= 1000
    assert stderr.strip().splitlines()[-1] == (
        f"preempted: SIGTERM received: saved {model_dir}/ckpt-{saved} at step {saved}; "
        "rerun the same command to resume"
    )
    args[args.index("experiment.max_steps = 1000000")] = f"experiment.max_steps = {saved + 10}"
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"from step {saved} to {saved + 10}" in resumed.stdout


def test_a_signal_that_lands_in_a_weakref_callback_still_ends_the_start():
    """A handler's exception raised in a weakref callback (importlib's module locks have
    one) is only printed by Python: the signal is sent again and ends the sleep after it."""

    class Module:
        pass

    def callback(_):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here, in the callback
            pass

    previous = signal.getsignal(signal.SIGINT), sys.unraisablehook
    with pytest.raises(preemption.Interrupted, match="SIGINT"):
        with preemption.outside_training():
            module = Module()
            watched = weakref.ref(module, callback)
            del module
            started = time.monotonic()
            time.sleep(60)
    assert watched() is None and time.monotonic() - started < 30  # not the sleep's end
    assert (signal.getsignal(signal.SIGINT), sys.unraisablehook) == previous


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--gin_param", "experiment.model_fn = @NoLoss()"],
            "error: NoLoss(mode='train'): Spec.loss is required in train mode",
        ),
        (["--num_devices", "two"], "error: "),
    ],
)
def test_a_run_that_fails_before_training_says_why_and_leaves_no_model_dir(
    tmp_path, faulty_gin, args, message
):
    """A contract broken while tracing keeps its message (not AutoGraph's "in user code:")."""
    new = tmp_path / "output" / "new"
    proc = run_cli("--gin_file", faulty_gin, "--model_dir", str(new), *args, env=ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message)
    assert not (tmp_path / "output").exists()


@pytest.mark.slow
def test_float_labels_that_are_whole_class_ids_train(tmp_path, faulty_gin):
    """3.0 is class 3 (3.5 is refused: the mistake table's label_not_a_class_id)."""
    proc = run_cli(
        "--gin_file",
        faulty_gin,
        "--model_dir",
        str(tmp_path / "new"),
        "--gin_param",
        "faulty_digits.fault = 'float_label'",
        "--gin_param",
        "experiment.max_steps = 10",
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkpoint_steps(tmp_path / "new") == [10]


def rerun_to_150(model_dir, faulty_gin):
    """The trained run's command again, to step 150."""
    args = ["--gin_param", "experiment.max_steps = 150"]
    return run_cli("--gin_file", faulty_gin, "--model_dir", str(model_dir), *args, env=ENV)


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, problem",
    [
        ("index", r"ckpt-100\.index is missing"),
        ("truncated", r"ckpt-100\.data-00000-of-00001 holds \d+ bytes of the \d+ its index lists"),
        ("flipped", r"[Cc]hecksum|crc|CRC|[Cc]orrupt"),
    ],
)
def test_a_damaged_newest_checkpoint_is_named_and_nothing_is_overwritten(
    model_dir, faulty_gin, damage, problem
):
    data = model_dir / "ckpt-100.data-00000-of-00001"
    if damage == "index":
        (model_dir / "ckpt-100.index").unlink()
    elif damage == "truncated":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    else:  # same length, a byte changed in the middle of the weights
        content = bytearray(data.read_bytes())
        content[len(content) // 2] ^= 0xFF
        data.write_bytes(bytes(content))
    before = dir_hash(model_dir)
    proc = rerun_to_150(model_dir, faulty_gin)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.fullmatch(
        rf"error: checkpoint {model_dir}/ckpt-100 is damaged \(.*({problem}).*\); intact: "
        rf"ckpt-50; move ckpt-100\.\* out of {model_dir} to resume from ckpt-50",
        proc.stderr.strip(),
    ), proc.stderr[-3000:]
    assert dir_hash(model_dir) == before


@pytest.mark.slow
def test_a_batch_size_change_resumes_a_positioned_input_at_its_example(tmp_path, data_dir):
    """digits is read by position: batch 64 goes on from the example batch 128 reached."""
    model_dir = tmp_path / "run"
    args = digits_args(
        data_dir,
        model_dir,
        "--gin_param",
        "experiment.max_steps = 20",
        "--gin_param",
        "experiment.eval_every_steps = None",
    )
    assert run_cli(*args).returncode == 0
    config = (model_dir / "operative_config.gin").read_text()
    assert "Estimator.global_batch_size = 128" in config
    args[args.index("experiment.max_steps = 20")] = "experiment.max_steps = 30"
    refused = run_cli(*args, "--gin_param", "Estimator.global_batch_size = 64")
    assert refused.returncode == 2 and "global_batch_size" in refused.stderr
    assert (model_dir / "operative_config.gin").read_text() == config
    proc = run_cli(*args, "--gin_param", "Estimator.global_batch_size = 64", "--overwrite_config")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader = tf.train.load_checkpoint(str(model_dir / "ckpt-30"))
    assert reader.get_tensor("input_position/.ATTRIBUTES/VARIABLE_VALUE") == 20 * 128 + 10 * 64
    assert "Estimator.global_batch_size = 64" in (model_dir / "operative_config.gin").read_text()


def test_a_signal_whose_exception_an_extension_replaces_still_ends_the_start():
    """The handler's Interrupted raised in Python code a C++ extension runs while raising
    an error of its own (TensorFlow making a collective's UnavailableError, on a worker
    whose peer stopped on the same SIGUSR1) comes out as pybind11's RuntimeError: the
    start still ends as the signal's, one line and 75, not that error's traceback."""

    def made_by_an_extension():
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):  # the handler runs here
                pass
        except preemption.Interrupted as landed:
            raise RuntimeError(
                "pybind11::error_already_set: MISMATCH of original and normalized active "
                f"exception types: ORIGINAL UnavailableError REPLACED BY Interrupted: {landed}"
            ) from None

    previous = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(preemption.Interrupted, match="SIGUSR1") as ended:
        with preemption.outside_training():
            made_by_an_extension()
    assert ended.value.exit_code == 75 and isinstance(ended.value.__cause__, RuntimeError)
    assert signal.getsignal(signal.SIGUSR1) == previous
    with pytest.raises(RuntimeError, match="its own"):  # no signal: the error as it is
        with preemption.outside_training():
            raise RuntimeError("an error of its own")
