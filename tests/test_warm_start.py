"""Warm start from another model: checkpoints, SavedModels and .keras files, by name."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from tests.support.body_head import BodyHead, built, estimator, weights
from tests.support.body_head import body_data as line_data
from trainer import warm_start
from trainer.settings import Optimization, WarmStart


class EncoderHead(trainer.ModelFn):
    """A body and a head under other names: a model of another structure."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.layers.Dense(8, activation="relu", name="encoder")
        self.head = keras.layers.Dense(1, name="head")

    def __call__(self, features, labels, mode):
        y = self.head(self.encoder(features["x"]))[:, 0]
        loss = None if labels is None else tf.reduce_mean((y - labels["y"]) ** 2)
        return trainer.Spec({"y": y}, loss=loss)


def test_a_keras_file_warm_starts_by_keras_path_through_a_name_map(tmp_path):
    source = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, name="body"), keras.layers.Dense(3, name="head")]
    )
    path = str(tmp_path / "source.keras")
    source.save(path)
    run = estimator(EncoderHead(), tmp_path / "run")
    before = built(run)
    report = warm_start.warm_start(run.model_fn, path, names={"^encoder/": "body/"})
    after = weights(run.model_fn)
    np.testing.assert_array_equal(after["encoder/kernel"], source.get_layer("body").kernel.numpy())
    np.testing.assert_array_equal(after["head/kernel"], before["head/kernel"])  # (8, 3) there
    assert report == {
        "loaded": ["encoder/kernel", "encoder/bias"],
        "skipped": ["head/kernel ((8, 3) there, (8, 1) here)", "head/bias ((3,) there, (1,) here)"],
        "left": [],
    }


def test_an_export_warm_starts_a_model_of_the_same_structure(tmp_path):
    trained = estimator(BodyHead(), tmp_path / "trained")
    trained.train(line_data, 20)
    export_dir = trained.export(line_data)
    run = estimator(BodyHead(), tmp_path / "run", warm_start=WarmStart(source=export_dir))
    run.train(line_data, 1)  # the warm start happens as training starts
    again = estimator(BodyHead(), tmp_path / "again")
    built(again)
    report = warm_start.warm_start(again.model_fn, export_dir)
    assert sorted(report["loaded"]) == ["body/_kernel", "body/bias", "head/_kernel", "head/bias"]
    for path, value in weights(trained.model_fn).items():
        np.testing.assert_array_equal(weights(again.model_fn)[path], value)
    # The run's warm start, then one step: the same step from the weights loaded here.
    again.train(line_data, 1)
    for path, value in weights(again.model_fn).items():
        np.testing.assert_allclose(weights(run.model_fn)[path], value, rtol=0, atol=1e-6)


def test_a_warm_start_that_loads_nothing_is_refused_and_assigns_nothing(tmp_path):
    source = estimator(BodyHead(), tmp_path / "source")
    source.train(line_data, 2)
    run = estimator(EncoderHead(), tmp_path / "run")
    before = built(run)
    with pytest.raises(trainer.UserError) as raised:
        warm_start.warm_start(
            run.model_fn, str(tmp_path / "source"), pattern="^encoder/", names={"^x": "y"}
        )
    assert str(raised.value) == (
        f"warm start from {tmp_path / 'source'} loaded nothing: no variable of this model is "
        "named as one of the source's after WarmStart.map (this model's are like "
        "encoder/_kernel, encoder/bias; the source's like body/_kernel, body/bias, "
        "head/_kernel): "
        "map them with WarmStart.map = {'pattern': 'replacement'}"
    )
    for path, value in weights(run.model_fn).items():
        np.testing.assert_array_equal(value, before[path])
    # The map that names the source's body: the encoder takes it, the head too.
    report = warm_start.warm_start(
        run.model_fn, str(tmp_path / "source"), names={"^encoder": "body"}
    )
    assert sorted(report["loaded"]) == [
        "encoder/_kernel",
        "encoder/bias",
        "head/_kernel",
        "head/bias",
    ]
    np.testing.assert_array_equal(
        run.model_fn.encoder.kernel.numpy(), source.model_fn.body.kernel.numpy()
    )


def digits_input_fn(mode, params):
    """Scikit-learn's digits as Keras users feed them: (x, y) tensors."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target.astype("int64")
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    if mode == trainer.Mode.TRAIN:
        return dataset.shuffle(2000, seed=0).repeat().batch(params.batch_size)
    return dataset.batch(params.batch_size)


def digits_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@pytest.mark.slow
def test_a_warm_start_with_a_moving_average_evaluates_the_warm_started_weights(tmp_path):
    """The average starts from the weights of the first step, not from the values the
    variables were made with (it evaluated 0.169 where the source evaluates 0.95)."""

    def run(model_dir, steps, **settings):
        estimator = trainer.Estimator(
            digits_mlp(), str(model_dir), global_batch_size=64, progress=False, **settings
        )
        estimator.train(digits_input_fn, max_steps=steps)
        return estimator.evaluate(digits_input_fn)["accuracy"]

    source = run(tmp_path / "source", 150)
    plain = run(tmp_path / "plain", 5, warm_start=WarmStart(source=str(tmp_path / "source")))
    averaged = run(
        tmp_path / "ema",
        5,
        warm_start=WarmStart(source=str(tmp_path / "source")),
        optimization=Optimization(ema_decay=0.99),
    )
    assert source > 0.9
    assert abs(averaged - plain) <= 0.01, (source, plain, averaged)
