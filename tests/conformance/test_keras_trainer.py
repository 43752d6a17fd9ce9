"""Keras 3.15's ``trainers/trainer_test.py`` cases of ``fit`` and ``evaluate``, ported:
``test_loss_weights`` and ``test_partial_loss_partial_label``.

Their models mix Keras's backend ``Trainer`` into a layer; here they are the same
layers in a ``keras.Model`` (the framework takes a ``keras.Model``). The data, compile
arguments and asserted numbers are Keras's. ``fit(x, y, batch_size=20, epochs=3)`` is
three epochs of two steps: here ``log_every_steps=2`` (an epoch of ``train``).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import initializers, layers, losses, metrics, optimizers

from trainer import Checkpoints, Estimator

pytestmark = pytest.mark.slow  # each trains, or runs Keras beside the Estimator


def ones(units):
    return layers.Dense(units, use_bias=False, kernel_initializer=initializers.Ones())


class ExampleModel(keras.Model):
    def __init__(self, units):
        super().__init__()
        self.dense = ones(units)

    def call(self, x):
        return self.dense(x)


class StructModel(keras.Model):
    def __init__(self, units):
        super().__init__()
        self.dense_1 = ones(units)
        self.dense_2 = ones(units)

    def call(self, x):
        return {"y_one": self.dense_1(x["x_one"]), "y_two": self.dense_2(x["x_two"])}


class ListOutputModel(keras.Model):
    def __init__(self, units):
        super().__init__()
        self.dense_1 = ones(units)
        self.dense_2 = ones(units)

    def call(self, x):
        return [self.dense_1(x), self.dense_2(x)]


def fitted(model, x, y, batch_size, epochs, model_dir):
    """``model.fit(x, y, batch_size=..., epochs=...)``'s History, by the Estimator."""
    history = keras.callbacks.History()
    steps = len(tf.nest.flatten(x)[0]) // batch_size
    estimator = Estimator(
        model,
        str(model_dir),
        global_batch_size=batch_size,
        steps_per_loop=steps,
        log_every_steps=steps,  # an epoch
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch_size)
    estimator.train(lambda mode, params: dataset, steps * epochs, [history])
    return history


def test_loss_weights(tmp_path):
    epochs = 3
    batch_size = 20
    dataset_size = batch_size * 2

    # Single output case.
    model = ExampleModel(units=3)
    model.compile(
        optimizer=optimizers.SGD(),
        loss=losses.MeanSquaredError(),
        metrics=[metrics.MeanSquaredError()],
        loss_weights=0.2,
    )
    x = np.ones((dataset_size, 4), "float32")
    y = np.zeros((dataset_size, 3), "float32")
    history = fitted(model, x, y, batch_size, epochs, tmp_path / "single")
    history = history.history
    assert "loss" in history
    np.testing.assert_allclose(history["loss"], [3.182979, 3.115617, 3.049681], atol=1e-3)

    # Dict output case.
    model = StructModel(units=3)
    model.compile(
        optimizer=optimizers.SGD(),
        loss={
            "y_one": losses.MeanSquaredError(),
            "y_two": losses.MeanSquaredError(),
        },
        metrics={
            "y_one": metrics.MeanSquaredError(),
            "y_two": metrics.MeanSquaredError(),
        },
        loss_weights={"y_one": 0.1, "y_two": 0.2},
    )
    x1 = np.ones((dataset_size, 4), "float32")
    x2 = np.ones((dataset_size, 4), "float32")
    y1 = np.zeros((dataset_size, 3), "float32")
    y2 = np.zeros((dataset_size, 3), "float32")
    history = fitted(
        model,
        {"x_one": x1, "x_two": x2},
        {"y_one": y1, "y_two": y2},
        batch_size,
        epochs,
        tmp_path / "dict",
    )
    history = history.history
    assert "loss" in history
    np.testing.assert_allclose(history["loss"], [4.778718, 4.694403, 4.611693], atol=1e-3)

    # List output case.
    model = ListOutputModel(units=3)
    model.compile(
        optimizer=optimizers.SGD(),
        loss=[losses.MeanSquaredError(), losses.MeanSquaredError()],
        metrics=[metrics.MeanSquaredError(), metrics.MeanSquaredError()],
        loss_weights=[0.1, 0.2],
    )
    x = np.ones((dataset_size, 4), "float32")
    y1 = np.zeros((dataset_size, 3), "float32")
    y2 = np.zeros((dataset_size, 3), "float32")
    history = fitted(model, x, (y1, y2), batch_size, epochs, tmp_path / "list")
    history = history.history
    assert "loss" in history
    np.testing.assert_allclose(history["loss"], [4.778718, 4.694403, 4.611693], atol=1e-3)


def test_partial_loss_partial_label(tmp_path):
    inputs = keras.Input((2,))
    x = keras.layers.Dense(3, kernel_initializer="ones")(inputs)
    partial_model = keras.Model(inputs, [x, x, x])
    partial_model.compile(loss=["mse", None, None])
    full_model = keras.Model(inputs, [x, x, x])
    full_model.compile(loss=["mse", "mse", "mse"])

    eval_x = np.ones((32, 2), "float32")
    eval_y = np.ones((32, 3), "float32")

    def evaluate(model, y, name):
        dataset = tf.data.Dataset.from_tensor_slices((eval_x, y)).batch(32)
        estimator = Estimator(model, str(tmp_path / name), eval_batch_size=32, progress=False)
        return estimator.evaluate(lambda mode, params: dataset)

    partial_logs = evaluate(partial_model, eval_y, "partial")
    logs = evaluate(full_model, (eval_y,) * 3, "full")

    assert partial_logs["loss"] * 3 == pytest.approx(logs["loss"])
