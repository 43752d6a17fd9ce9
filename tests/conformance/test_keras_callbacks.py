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
