"""The contract: Mode, Spec checks, variable discovery, PREDICT without labels."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from models.mlp import MLP
from trainer import Estimator, InputParams, Mode, ModelFn, Spec, UserError
from trainer.model_fn import check_spec


def test_modes_use_estimator_strings():
    assert [m.value for m in Mode] == ["train", "eval", "infer"]
    assert Mode("infer") is Mode.PREDICT


class Nested(ModelFn):
    def __init__(self):
        super().__init__()
        self.blocks = [keras.layers.Dense(3), {"head": keras.layers.Dense(2)}]
        self.shared = self.blocks[0]  # the same layer twice must count once
        self.dropout = keras.layers.Dropout(0.5, seed=1)
        self.scale = tf.Variable(1.0, name="scale")
        self.frozen = tf.Variable(2.0, trainable=False, name="frozen")

    def __call__(self, features, labels, mode):
        x = self.dropout(self.blocks[0](features["x"]), training=mode == Mode.TRAIN)
        return Spec({"y": self.blocks[1]["head"](x) * self.scale})


def test_variables_are_found_in_lists_dicts_and_attributes():
    model = Nested()
    model({"x": tf.ones([4, 5])}, None, Mode.PREDICT)
    shapes = sorted(tuple(v.shape) for v in model.trainable_variables)
    assert shapes == [(), (2,), (3,), (3, 2), (5, 3)]
    names = [v.name for v in model.non_trainable_variables]
    assert any("seed_generator_state" in n for n in names), names  # dropout RNG state
    assert any("frozen" in n for n in names)
    assert len(model.layers) == 3


def spec_for(loss=None, metrics=None):
    return Spec({"y": tf.zeros([4])}, loss=loss, metrics=metrics or {})


@pytest.mark.parametrize(
    "spec, mode, message",
    [
        (spec_for(), Mode.TRAIN, "Spec.loss is required"),
        (spec_for(loss=tf.zeros([4])), Mode.EVAL, "must be a scalar"),
        (spec_for(tf.zeros([]), {"acc": tf.zeros([])}), Mode.EVAL, "one value per example"),
        (spec_for(tf.zeros([]), {"loss": tf.zeros([4])}), Mode.EVAL, "reserved"),
        (  # streamed: its result would stand where the model's loss is reported
            spec_for(tf.zeros([]), {"loss": (keras.metrics.Mean(), tf.zeros([4]))}),
            Mode.EVAL,
            "metric name 'loss' is reserved for Spec.loss",
        ),
        (
            spec_for(tf.zeros([]), {"auc": ("AUC", tf.zeros([4]), tf.zeros([4]))}),
            Mode.EVAL,
            r"metric 'auc' is a tuple whose first item is str; give a tensor of per-example "
            r"values, \(values, weights\), or \(keras.metrics.Metric, \*update_state args\)",
        ),
        (
            spec_for(tf.zeros([]), {"acc": (tf.zeros([4]), tf.zeros([4, 1]))}),
            Mode.EVAL,
            r"metric 'acc' must hold one value per example \(shape \[batch\]\), got shape \(4, 1\)",
        ),
        (
            dataclasses.replace(spec_for(tf.zeros([])), loss_reduction="sum_over_batch_size"),
            Mode.TRAIN,
            "Spec.loss_reduction must be one of mean, sum, got 'sum_over_batch_size'",
        ),
        (Spec({}), Mode.PREDICT, "non-empty dict"),
        ({"y": 1}, Mode.PREDICT, "return a trainer.Spec"),
    ],
)
def test_check_spec_names_what_is_wrong(spec, mode, message):
    with pytest.raises(ValueError, match=message):
        check_spec(spec, mode, "M")


def test_check_spec_accepts_predict_without_loss():
    check_spec(spec_for(), Mode.PREDICT, "M")


def test_check_spec_accepts_a_streamed_keras_metric():
    streamed = (keras.metrics.AUC(), tf.zeros([4]), tf.zeros([4]))
    check_spec(spec_for(tf.zeros([]), {"auc": streamed}), Mode.EVAL, "M")


def test_mlp_predicts_without_labels():
    model = MLP(num_classes=10, hidden_units=[16])
    spec = model({"image": tf.zeros([3, 8, 8, 1])}, None, Mode.PREDICT)
    assert spec.loss is None and spec.metrics == {}
    assert spec.predictions["classes"].shape == (3,)
    np.testing.assert_allclose(tf.reduce_sum(spec.predictions["probabilities"], -1), 1.0, rtol=1e-6)


def test_dropout_is_active_in_train_only():
    model = MLP(num_classes=4, hidden_units=[64], dropout_rate=0.5)
    features, labels = {"image": tf.ones([2, 8, 8, 1])}, {"label": tf.constant([0, 1])}
    runs = {
        mode: [model(features, labels, mode).predictions["probabilities"].numpy() for _ in range(2)]
        for mode in (Mode.TRAIN, Mode.EVAL)
    }
    assert not np.allclose(*runs[Mode.TRAIN])
    np.testing.assert_array_equal(*runs[Mode.EVAL])


def test_estimator_predicts_from_a_features_only_dataset(tmp_path):
    """PREDICT input may carry no labels; the model never sees any."""
    seen_labels = []

    class Recorder(MLP):
        def __call__(self, features, labels, mode):
            seen_labels.append((mode, labels))
            return super().__call__(features, labels, mode)

    def input_fn(mode, params):
        assert mode == Mode.PREDICT and isinstance(params, InputParams)
        return tf.data.Dataset.from_tensor_slices({"image": tf.zeros([5, 8, 8, 1])}).batch(2)

    estimator = Estimator(Recorder(hidden_units=[8]), str(tmp_path), global_batch_size=2)
    with pytest.raises(UserError, match="no checkpoint"):
        list(estimator.predict(input_fn))
    estimator.train(
        lambda m, p: tf.data.Dataset.from_tensors(
            ({"image": tf.zeros([2, 8, 8, 1])}, {"label": tf.constant([1, 2])})
        ).repeat(),
        2,
    )
    predictions = list(estimator.predict(input_fn))
    assert len(predictions) == 5 and predictions[0]["probabilities"].shape == (10,)
    assert all(labels is None for mode, labels in seen_labels if mode == Mode.PREDICT)


class ListInKerasLayer(keras.layers.Layer):
    def __init__(self):
        super().__init__()
        self.stack = [keras.layers.Dense(4), keras.layers.Dense(2)]  # invisible to checkpoints

    def call(self, x):
        for layer in self.stack:
            x = layer(x)
        return x


class Hidden(ModelFn):
    def __init__(self):
        super().__init__()
        self.body = ListInKerasLayer()

    def __call__(self, features, labels, mode):
        return Spec({"y": self.body(features["x"])})


def test_variables_a_checkpoint_cannot_reach_are_refused_before_training(tmp_path):
    def input_fn(mode, params):
        return tf.data.Dataset.from_tensors({"x": tf.zeros([2, 3])})

    with pytest.raises(UserError, match=r"holds variables a checkpoint cannot reach \(.*kernel"):
        Estimator(Hidden(), str(tmp_path)).export(input_fn)


class OwnTable(ModelFn):
    """Looks a feature up in a table of its own, which lacks it: a bug, not bad input."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)
        self.table = {"other": 1}

    def __call__(self, features, labels, mode):
        logits = self.dense(features["x"]) * self.table["x"]
        return Spec({"logits": logits}, loss=tf.reduce_mean(logits))


def test_a_missing_feature_is_a_user_error_and_a_bug_keeps_its_key_error(tmp_path):
    def input_fn(mode, params):
        return tf.data.Dataset.from_tensors(({"x": tf.ones([4, 3])}, {"y": tf.zeros([4])}))

    with pytest.raises(UserError, match=r"MLP looks up 'image', which the input_fn does not give "):
        Estimator(MLP(num_classes=2), str(tmp_path / "mlp"), global_batch_size=4).train(input_fn, 1)
    with pytest.raises(KeyError):  # 'x' is a feature: the lookup that failed is the model's own
        Estimator(OwnTable(), str(tmp_path / "own"), global_batch_size=4).train(input_fn, 1)


def test_a_streamed_metric_must_report_one_number():
    from trainer.errors import UserError
    from trainer.metrics import MetricSums

    sums = MetricSums([], streamed={"f1": keras.metrics.F1Score(), "auc": keras.metrics.AUC()})
    y, p = tf.constant([[1.0, 0.0], [0.0, 1.0]]), tf.constant([[0.9, 0.1], [0.2, 0.8]])
    sums.stream({"f1": (sums.streamed["f1"], y, p), "auc": (sums.streamed["auc"], y, p)})
    sums.update({}, {"loss": tf.constant(0.5)}, tf.constant(2.0, tf.float64))
    with pytest.raises(UserError, match=r"metric 'f1' \(F1Score\) has a result of shape \[2\]"):
        sums.result()
    del sums.streamed["f1"]
    assert sums.result() == {"loss": 0.5, "auc": 1.0}
