"""Keras 3.15's own callback tests, ported: each case run by fit and by the Estimator.

Keras tests its callbacks (``keras/src/callbacks/*_test.py``) under ``fit``. Each case
below takes one of them (named in its id) to the Estimator: the same compiled model
from the same weights, the same batches in the same order, an epoch of 7 steps and a
validation on the same 448 digits after each. What the callbacks see and do must be
what they see and do under ``fit``: the epochs run, each epoch's logs, the learning
rate, the weights left, what a RemoteMonitor posts. Cases already ported elsewhere
(CSVLogger's columns, LambdaCallback's arguments, a stop mid-epoch, EarlyStopping
reused, TerminateOnNaN) are in ``test_callbacks.py``; a case Keras tests on a stand-in
model, or on ``predict``, has nothing of the Estimator's to meet.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

from trainer import Checkpoints, Estimator, Mode

STEPS = 7  # an epoch: 448 digits in batches of 64
DIGITS = load_digits()
X = DIGITS.images[: STEPS * 64, :, :, None].astype("float32") / 16.0
Y = DIGITS.target[: STEPS * 64]


def linear():
    """A linear classifier of the digits, compiled as a Keras user compiles it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.1), loss, metrics=["accuracy"])
    return model


def input_fn(mode, params):
    batches = tf.data.Dataset.from_tensor_slices((X, Y)).batch(params.batch_size)
    return batches.repeat() if mode == Mode.TRAIN else batches


class Record(keras.callbacks.Callback):
    """Each epoch's logs and the learning rate the optimizer holds at its end."""

    def __init__(self):
        super().__init__()
        self.epochs, self.rates = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((epoch, {k: float(np.reshape(v, ())) for k, v in logs.items()}))
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def runs(made, epochs, model_dir):
    """``(fit's Record, model), (the Estimator's Record, model)`` with ``made()``'s
    callbacks (a fresh set for each) over up to ``epochs`` epochs."""
    theirs, fit_record = linear(), Record()
    theirs.fit(
        X,
        Y,
        64,
        epochs,
        verbose=0,
        shuffle=False,
        validation_data=(X, Y),
        callbacks=[*made(), fit_record],
    )
    ours, record = linear(), Record()
    estimator = Estimator(
        ours,
        str(model_dir),
        global_batch_size=64,
        eval_batch_size=64,
        steps_per_loop=STEPS,
        log_every_steps=STEPS,
        checkpoints=Checkpoints(every_steps=STEPS),
        seed=0,
        progress=False,
    )
    estimator.train_and_evaluate(
        input_fn, input_fn, STEPS * epochs, eval_every_steps=STEPS, callbacks=[*made(), record]
    )
    return (fit_record, theirs), (record, ours)


def assert_alike(fit_run, our_run):
    """The same epochs, logs (within float noise), rates and final weights."""
    (fit_record, theirs), (record, ours) = fit_run, our_run
    assert [e for e, _ in record.epochs] == [e for e, _ in fit_record.epochs]
    for (epoch, logs), (_, fit_logs) in zip(record.epochs, fit_record.epochs, strict=True):
        assert sorted(logs) == sorted(fit_logs), epoch
        for key, value in fit_logs.items():
            assert logs[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (epoch, key)
    np.testing.assert_allclose(record.rates, fit_record.rates, rtol=1e-6)
    for mine, fits in zip(ours.weights, theirs.weights, strict=True):
        np.testing.assert_allclose(mine.numpy(), fits.numpy(), atol=2e-5, err_msg=mine.path)


CASES = {
    # early_stopping_test: test_early_stopping_with_baseline (val_accuracy never
    # reaches the baseline, so its wait is never reset; it improves every epoch, and
    # Keras stops only at an epoch that does not improve: all 6 run)
    "early_stopping_with_baseline": (
        lambda: [keras.callbacks.EarlyStopping("val_accuracy", patience=2, baseline=0.999)],
        6,
        6,
    ),
    # test_early_stopping_with_start_from_epoch: the first two epochs are not judged
    "early_stopping_with_start_from_epoch": (
        lambda: [
            keras.callbacks.EarlyStopping(
                "val_loss", min_delta=10.0, patience=1, start_from_epoch=2
            )
        ],
        8,
        4,
    ),
    # test_early_stopping_final_weights_when_restoring_model_weights: the best (first)
    # epoch's weights are put back when it stops
    "early_stopping_restores_the_best_weights": (
        lambda: [
            keras.callbacks.EarlyStopping(
                "val_loss", min_delta=10.0, patience=2, restore_best_weights=True
            )
        ],
        6,
        3,
    ),
    # reduce_lr_on_plateau_test: test_honors_min_lr and test_cooldown
    "reduce_lr_on_plateau_with_cooldown_and_min_lr": (
        lambda: [
            keras.callbacks.ReduceLROnPlateau(
                "val_loss", factor=0.5, patience=1, min_delta=10.0, cooldown=1, min_lr=0.02
            )
        ],
        7,
        7,
    ),
    # learning_rate_scheduler_test: test_schedule_dependent_on_previous_learning_rate
    # and test_learning_rate_in_history (the logs carry learning_rate)
    "learning_rate_scheduler_from_the_previous_rate": (
        lambda: [keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5**epoch)],
        4,
        4,
    ),
    # monitor_callback_test: test_min_delta (accuracy should grow, by 0.5 to count)
    "early_stopping_on_accuracy_with_min_delta": (
        lambda: [keras.callbacks.EarlyStopping("accuracy", min_delta=0.5, patience=1)],
        5,
        2,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_keras_callback_case_runs_as_under_fit(tmp_path, case):
    made, epochs, run = CASES[case]
    fit_run, our_run = runs(made, epochs, tmp_path / "run")
    assert len(fit_run[0].epochs) == run  # the case does what Keras's test says
    assert_alike(fit_run, our_run)


class Posts(BaseHTTPRequestHandler):
    """A RemoteMonitor's server: keeps each JSON body posted."""

    bodies: list

    def do_POST(self):  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        self.bodies.append(json.loads(self.rfile.read(length)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_a_remote_monitor_posts_what_it_posts_under_fit(tmp_path):
    """remote_monitor_test: test_RemoteMonitorWithJsonPayload, against a real server on
    127.0.0.1: one post an epoch, with fit's keys (no learning_rate) and values."""
    bodies = []
    handler = type("Handler", (Posts,), {"bodies": bodies})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_port}"
    try:
        runs(
            lambda: [keras.callbacks.RemoteMonitor(root, path="/", send_as_json=True)], 2, tmp_path
        )
    finally:
        server.shutdown()
        server.server_close()
    fits, ours = bodies[:2], bodies[2:]
    assert len(ours) == 2 and [sorted(b) for b in ours] == [sorted(b) for b in fits]
    assert sorted(ours[0]) == ["accuracy", "epoch", "loss", "val_accuracy", "val_loss"]
    for mine, theirs in zip(ours, fits, strict=True):
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
