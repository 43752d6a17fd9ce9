"""Warm start from another model: checkpoints, SavedModels and .keras files, by name."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from tests.test_groups import BodyHead, built, estimator, line_data, weights
from trainer import warm_start


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
    run = estimator(BodyHead(), tmp_path / "run", warm_start_from=export_dir)
    run.train(line_data, 1)  # the warm start happens as training starts
    again = estimator(BodyHead(), tmp_path / "again")
    built(again)
    report = warm_start.warm_start(again.model_fn, export_dir)
    assert sorted(report["loaded"]) == ["body/_kernel", "body/bias", "head/_kernel", "head/bias"]
    for path, value in weights(trained.model_fn).items():
        np.testing.assert_array_equal(weights(again.model_fn)[path], value)
        assert np.abs(weights(run.model_fn)[path] - value).max() < 0.05  # then one step


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
        "named as one of the source's after Estimator.warm_start_map (this model's are like "
        "encoder/_kernel, encoder/bias; the source's like body/_kernel, body/bias, "
        "head/_kernel): "
        "map them with Estimator.warm_start_map = {'pattern': 'replacement'}"
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
