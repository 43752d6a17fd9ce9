"""Keras 3.15's ``trainers/trainer_test.py`` cases of ``fit``, ``evaluate`` and
``predict``, ported: ``test_fit_flow`` (in a graph and under XLA), ``test_evaluate_flow``,
``test_predict_flow``, ``test_predict_flow_struct``, ``test_nested_input_predict``,
``test_nested_inputs``, ``test_evaluate_with_different_batch_size_same_loss``,
``test_evaluate_return_list_respect_metrics_order``, ``test_constraints_are_applied``,
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

from trainer import Checkpoints, Devices, Estimator

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


class ListInputModel(keras.Model):
    def __init__(self, units):
        super().__init__()
        self.dense_1 = ones(units)
        self.dense_2 = ones(units)

    def call(self, x):
        if not isinstance(x, list | tuple):
            raise ValueError("x must be a list or tuple")
        return self.dense_1(x[0]) + self.dense_2(x[1])


def fitted(model, x, y, batch_size, epochs, model_dir, jit_compile=False):
    """``model.fit(x, y, batch_size=..., epochs=...)``'s History, by the Estimator.

    Under XLA (``jit_compile``) the batches are of one fixed size (``drop_remainder``),
    which the framework asks for there.
    """
    history = keras.callbacks.History()
    steps = len(tf.nest.flatten(x)[0]) // batch_size
    estimator = Estimator(
        model,
        str(model_dir),
        global_batch_size=batch_size,
        steps_per_loop=steps,
        log_every_steps=steps,  # an epoch
        checkpoints=Checkpoints(every_steps=None),
        devices=Devices(jit_compile=jit_compile),
        progress=False,
    )
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    dataset = dataset.batch(batch_size, drop_remainder=jit_compile)
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


def evaluated(model, x, y, batch_size, model_dir):
    """``model.evaluate(x, y, batch_size=..., return_dict=True)``, by the Estimator."""
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    estimator = Estimator(model, str(model_dir), eval_batch_size=batch_size, progress=False)
    logs = estimator.evaluate(lambda mode, params: dataset)
    return {name: value for name, value in logs.items() if name != "global_step"}


def predicted(model, x, batch_size, model_dir):
    """``model.predict(x, batch_size=...)``: the examples' predictions stacked.

    ``x`` is each element's features, ``(x,)``, as Keras's adapter of arrays makes it.
    """
    dataset = tf.data.Dataset.from_tensor_slices((x,)).batch(batch_size)
    estimator = Estimator(model, str(model_dir), eval_batch_size=batch_size, progress=False)
    rows = list(estimator.predict(lambda mode, params: dataset))
    return {name: np.stack([row[name] for row in rows]) for name in rows[0]}


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph_fn", "jit"])
def test_fit_flow(jit_compile, tmp_path):
    model = ExampleModel(units=3)
    epochs = 3
    batch_size = 20
    steps_per_epoch = 7
    dataset_size = batch_size * (steps_per_epoch - 2)
    x = np.ones((dataset_size, 4), "float32")
    y = np.zeros((dataset_size, 3), "float32")

    model.compile(
        optimizer=optimizers.SGD(),
        loss=losses.MeanSquaredError(),
        metrics=[metrics.MeanSquaredError()],
    )
    history = fitted(model, x, y, batch_size, epochs, tmp_path, jit_compile=jit_compile)
    history = history.history
    assert "loss" in history
    assert "mean_squared_error" in history
    np.testing.assert_allclose(history["mean_squared_error"], [14.5, 11.5, 8.5], atol=1.0)


def test_evaluate_flow(tmp_path):
    model = ExampleModel(units=3)
    x = np.ones((100, 4), "float32")
    y = np.zeros((100, 3), "float32")
    batch_size = 16

    model.compile(
        optimizer=optimizers.SGD(),
        loss=losses.MeanSquaredError(),
        metrics=[metrics.MeanSquaredError()],
    )
    output = evaluated(model, x, y, batch_size, tmp_path)
    assert list(output) == ["loss", "mean_squared_error"]  # evaluate's list, in its order
    np.testing.assert_allclose(list(output.values()), [16.0, 16.0])
    assert output["mean_squared_error"] == pytest.approx(16.0)


def test_predict_flow(tmp_path):
    model = ExampleModel(units=3)
    x = np.ones((100, 4), "float32")
    batch_size = 16
    outputs = predicted(model, x, batch_size, tmp_path)
    np.testing.assert_allclose(outputs["output"], 4 * np.ones((100, 3)))


def test_predict_flow_struct(tmp_path):
    model = StructModel(units=3)
    x = {"x_one": np.ones((100, 4), "float32"), "x_two": np.ones((100, 4), "float32")}
    batch_size = 16
    outputs = predicted(model, x, batch_size, tmp_path)
    assert len(outputs) == 2
    np.testing.assert_allclose(outputs["y_one"], 4 * np.ones((100, 3)))
    np.testing.assert_allclose(outputs["y_two"], 4 * np.ones((100, 3)))


def test_nested_input_predict(tmp_path):
    class TupleInputModel(keras.Model):
        def call(self, inputs):
            a, b = inputs
            return a + b

    model = TupleInputModel()
    x1, x2 = np.random.rand(2, 3, 4).astype("float32")
    out = predicted(model, (x1, x2), 3, tmp_path / "tuple")
    assert out["output"].shape == (3, 4)

    class DictInputModel(keras.Model):
        def call(self, inputs):
            return inputs["a"] + inputs["b"]

    model = DictInputModel()
    out = predicted(model, {"a": x1, "b": x2}, 3, tmp_path / "dict")
    assert out["output"].shape == (3, 4)


def test_nested_inputs(tmp_path):
    model = ListInputModel(units=2)
    out = model([np.ones((3, 2)), np.ones((3, 3))])
    assert tuple(out.shape) == (3, 2)
    model.compile(optimizer="sgd", loss="mse", metrics=["mse"])
    x = (np.ones((3, 2), "float32"), np.ones((3, 3), "float32"))
    y = np.ones((3, 2), "float32")
    # fit(x, y), then train_on_batch(x, y): two epochs of one step.
    history = fitted(model, x, y, 3, 2, tmp_path).history
    np.testing.assert_allclose(history["loss"][0], 16.0)
    np.testing.assert_allclose(history["loss"][1], 14.44, atol=1e-1)
    eval_out = evaluated(model, x, y, 3, tmp_path)
    np.testing.assert_allclose(eval_out["loss"], 13.0321, atol=1e-2)
    predict_out = predicted(model, x, 3, tmp_path)
    assert predict_out["output"].shape == (3, 2)


def test_evaluate_with_different_batch_size_same_loss(tmp_path):
    x = np.random.rand(100, 4).astype("float32")
    y = np.ones((100, 1), "float32")
    model = ExampleModel(units=1)
    model.compile(loss="mse")
    loss1 = evaluated(model, x, y, 80, tmp_path / "80")["loss"]
    loss2 = evaluated(model, x, y, 100, tmp_path / "100")["loss"]
    assert loss1 == pytest.approx(loss2, rel=1e-6)


def test_evaluate_return_list_respect_metrics_order(tmp_path):
    def metrics_zero(y_true, y_pred):
        return 0.0

    def metrics_one(y_true, y_pred):
        return 1.0

    model = ExampleModel(units=3)
    model.compile(optimizer="sgd", loss="mse", metrics=[metrics_zero, metrics_one])
    x, y = np.ones((3, 2), "float32"), np.ones((3, 3), "float32")
    eval_out = list(evaluated(model, x, y, 3, tmp_path / "zero_one").values())
    assert len(eval_out) == 3
    assert eval_out[1] == 0.0
    assert eval_out[2] == 1.0

    model.compile(optimizer="sgd", loss="mse", metrics=[metrics_one, metrics_zero])
    eval_out = list(evaluated(model, x, y, 3, tmp_path / "one_zero").values())
    assert len(eval_out) == 3
    assert eval_out[1] == 1.0
    assert eval_out[2] == 0.0


def test_constraints_are_applied(tmp_path):
    model = keras.Sequential([layers.Dense(2, kernel_constraint="non_neg")])
    x = np.ones((2, 3), "float32")
    y = np.ones((2, 2), "float32")
    model.compile(optimizer="rmsprop", loss="mse")
    fitted(model, x, y, 2, 1, tmp_path)
    assert np.min(keras.ops.convert_to_numpy(model.layers[0].kernel)) >= 0.0
