"""Keras 3.15's callback tests of a run stopped mid-epoch, ported: ``fit`` against the
Estimator on the same model, weights and batches.

``callbacks/terminate_on_nan_test.py`` stops training at a NaN loss; any callback
that sets ``model.stop_training`` in ``on_train_batch_end`` does the same. ``fit`` then
ends the epoch it was in: ``on_epoch_end(epoch, {'loss': nan, ...})``, the batch
numbered within its epoch, History and CSVLogger holding that row.
"""

import csv

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer import Checkpoints, Estimator

pytestmark = pytest.mark.slow  # each trains, or runs Keras beside the Estimator

BATCH, EPOCH = 8, 4  # an epoch of 4 steps


class Events(keras.callbacks.Callback):
    """Every batch end and epoch end, with its index and logs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("batch", batch, sorted(logs or {})))

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(("epoch", epoch, {k: float(v) for k, v in (logs or {}).items()}))


def linear():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("bad_batch", [0, 2])
def test_terminate_on_nan_ends_the_epoch_it_stopped_in_as_fit_does(tmp_path, bad_batch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * EPOCH, 4)).astype("float32")
    y = (x.sum(1) > 0).astype("int64")
    x[bad_batch * BATCH : (bad_batch + 1) * BATCH] = np.nan

    def callbacks(name):
        return [
            keras.callbacks.TerminateOnNaN(),
            Events(),
            keras.callbacks.History(),
            keras.callbacks.CSVLogger(str(tmp_path / f"{name}.csv")),
        ]

    theirs = callbacks("fit")
    linear().fit(x, y, BATCH, epochs=2, verbose=0, shuffle=False, callbacks=theirs)
    ours = callbacks("ours")
    estimator = Estimator(
        linear(),
        str(tmp_path / "model"),
        global_batch_size=BATCH,
        steps_per_loop=1,
        log_every_steps=EPOCH,  # an epoch
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    estimator.train(
        lambda mode, params: tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH),
        2 * EPOCH,
        ours,
    )
    for ours_seen, theirs_seen in zip(ours[1].seen, theirs[1].seen, strict=True):
        assert ours_seen[:2] == theirs_seen[:2]
    assert ours[1].seen[-1] == ("epoch", 0, {"loss": pytest.approx(np.nan, nan_ok=True)})
    assert np.isnan(ours[2].history["loss"]) and len(ours[2].history["loss"]) == 1
    rows = list(csv.DictReader(open(tmp_path / "ours.csv")))
    assert rows == list(csv.DictReader(open(tmp_path / "fit.csv")))
    assert rows == [{"epoch": "0", "loss": "nan", "val_loss": "NA"}]


def test_early_stopping_with_start_from_epoch(tmp_path):
    """``early_stopping_test.test_early_stopping_with_start_from_epoch``, as written but
    for ``fit``: two runs of the same model, an epoch a step of the 10 examples.

    Changed on purpose: the second ``train`` goes on in the same model_dir, so its
    epochs go on from the first's (as ``fit(initial_epoch=...)`` numbers them), where a
    second ``fit`` numbers from 0: ``start_from_epoch`` counts from the run's start
    (here the second run stops after 2 epochs, where ``fit``'s stops after 4). Keras's
    assertions hold as written.
    """
    rng = np.random.default_rng(0)
    x_train = rng.random((10, 5)).astype("float32")
    y_train = rng.random((10, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        (
            keras.layers.Dense(1, activation="relu"),
            keras.layers.Dense(1, activation="relu"),
        )
    )
    model.compile(optimizer="sgd", loss="mae", metrics=["mse"])
    estimator = Estimator(
        model,
        str(tmp_path),
        global_batch_size=10,
        steps_per_loop=1,
        log_every_steps=1,  # an epoch: one step, as fit's of 10 examples
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )

    def fit(stopper, epochs):
        history = keras.callbacks.History()
        start = estimator.train(input_fn, epochs, [stopper, history])
        return history, start

    def input_fn(mode, params):
        return tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat().batch(10)

    start_from_epoch = 2
    patience = 3
    stopper = keras.callbacks.EarlyStopping(
        monitor="mse",
        patience=patience,
        start_from_epoch=start_from_epoch,
    )
    history, stopped_at = fit(stopper, 20)
    # Test 'patience' argument functions correctly when used
    # in conjunction with 'start_from_epoch'.
    assert len(history.epoch) >= patience + start_from_epoch
    assert history.epoch == list(range(stopped_at))

    start_from_epoch = 2
    patience = 0
    stopper = keras.callbacks.EarlyStopping(
        monitor="mse",
        patience=patience,
        start_from_epoch=start_from_epoch,
    )
    history, _ = fit(stopper, stopped_at + 20)
    # Test for boundary condition when 'patience' = 0.
    assert len(history.epoch) >= start_from_epoch
    # The run's epochs go on, and a History made alike takes back the run's so far.
    assert history.epoch[: stopped_at + 1] == list(range(stopped_at + 1))


def test_model_state_is_current_on_epoch_end(tmp_path):
    """``callback_test.test_model_state_is_current_on_epoch_end``, as written but for
    ``fit``: a model whose only state is a non-trainable variable its call updates
    trains (no trainable variable, as ``fit`` runs it), and each batch's callback sees
    it current."""

    class TestModel(keras.Model):
        def __init__(self):
            super().__init__()
            self.iterations = self.add_variable(shape=(), initializer="zeros", trainable=False)

        def call(self, inputs):
            self.iterations.assign(self.iterations + 1)
            return inputs

    seen = []

    class CBK(keras.callbacks.Callback):
        def on_batch_end(self, batch, logs):
            assert int(self.model.iterations) == batch + 1
            seen.append(batch)

    model = TestModel()
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.random((8, 1)).astype("float32")
    y = np.random.random((8, 1)).astype("float32")
    estimator = Estimator(
        model,
        str(tmp_path),
        global_batch_size=2,
        steps_per_loop=1,
        log_every_steps=4,  # an epoch: fit's 8 examples in batches of 2
        progress=False,
    )
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(2)
    estimator.train(lambda mode, params: dataset, 4, [CBK()])
    assert seen == [0, 1, 2, 3]
