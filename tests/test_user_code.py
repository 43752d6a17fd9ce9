"""The user's own code as README teaches it, honoured or refused, never silently changed."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer


def labelled_data(mode, params):
    """An input_fn as README writes one: arrays, shuffled and batched."""
    rng = np.random.default_rng(0 if mode == trainer.Mode.TRAIN else 1)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x[:, 0] + 0.3 * rng.normal(size=256) > 0).astype("int64")
    dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, {"y": y}))
    if mode == trainer.Mode.TRAIN:
        dataset = dataset.shuffle(256, seed=params.seed).repeat()
    return dataset.batch(params.batch_size)


class AucOnlyInEval(trainer.ModelFn):
    """A classifier that reports its AUC in evaluation only, as a user may write it."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.auc = keras.metrics.AUC()

    def __call__(self, features, labels, mode):
        logit = self.dense(features["x"])[:, 0]
        probability = tf.sigmoid(logit)
        if labels is None:
            return trainer.Spec(predictions={"probability": probability})
        y = tf.cast(labels["y"], tf.float32)
        loss = tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logit)
        metrics = {"err": tf.cast(tf.not_equal(probability > 0.5, y > 0.5), tf.float32)}
        if mode == trainer.Mode.EVAL:
            metrics["auc"] = (self.auc, y, probability)
        return trainer.Spec({"probability": probability}, tf.reduce_mean(loss), metrics)


@pytest.mark.slow
def test_metrics_made_in_one_mode_only_are_found_when_that_mode_is_first_traced(tmp_path):
    """The EVAL-only AUC is reported and ranks the best export, after training traced first;
    evaluated first, a later training logs only what TRAIN makes."""
    estimator = trainer.Estimator(
        AucOnlyInEval(),
        str(tmp_path),
        global_batch_size=32,
        optimizer=keras.optimizers.Adam(0.05),
        best_export=trainer.BestExport(metric="auc"),
        progress=False,
    )
    final = estimator.train_and_evaluate(labelled_data, labelled_data, 40, eval_every_steps=20)
    assert sorted(final["eval"]) == ["auc", "err", "loss"]
    assert 0.8 < final["eval"]["auc"] <= 1.0 and final["eval"]["err"] < 0.3
    assert (tmp_path / "export" / "best" / "best.json").is_file()
    again = trainer.Estimator(AucOnlyInEval(), str(tmp_path), global_batch_size=32, progress=False)
    assert again.evaluate(labelled_data) == estimator.evaluate(labelled_data)
    assert again.train(labelled_data, max_steps=50) == 50


def test_a_keras_models_single_output_is_keyed_by_the_name_the_user_gave_or_output():
    """Not by Keras's layer counter (dense in one process, dense_2 in another)."""
    from trainer.keras_model import KerasModel

    def functional(name=None, layers_before=0):
        for _ in range(layers_before):  # layers made earlier move Keras's counter on
            keras.layers.Dense(1)
        x = keras.Input((4,), name="x")
        model = keras.Model(x, keras.layers.Dense(1, name=name)(x))
        model.compile(loss="mse")
        return KerasModel(model)

    features = {"x": tf.zeros([2, 4])}
    for model in (functional(), functional(layers_before=3)):
        assert list(model(features, None, trainer.Mode.PREDICT).predictions) == ["output"]
    named = functional("price")(features, None, trainer.Mode.PREDICT)
    assert list(named.predictions) == ["price"]


def bare_labels(mode, params):
    """The Keras habit: labels as a bare tensor beside a dict of features."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y))
    if mode == trainer.Mode.TRAIN:
        dataset = dataset.repeat()
    return dataset.batch(params.batch_size)


def test_bare_labels_train_a_single_output_keras_model(tmp_path):
    x = keras.Input((4,), name="x")
    model = keras.Model(x, keras.layers.Dense(2)(x))
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    estimator = trainer.Estimator(model, str(tmp_path), global_batch_size=32, progress=False)
    estimator.train(bare_labels, max_steps=30)
    assert estimator.evaluate(bare_labels)["accuracy"] > 0.9


def test_bare_labels_for_a_model_that_reads_them_by_key_say_how_to_name_them(tmp_path):
    estimator = trainer.Estimator(AucOnlyInEval(), str(tmp_path), global_batch_size=32)
    with pytest.raises(trainer.UserError) as error:
        estimator.train(bare_labels, max_steps=1)
    assert str(error.value) == (
        "AucOnlyInEval reads its labels by key, but the input_fn's labels are a bare tensor "
        "(int64 [None]): name them, e.g. end the input_fn with "
        ".map(lambda features, label: (features, {'label': label})) and read labels['label']"
    )
    assert [f for f in os.listdir(tmp_path) if f != ".trainer.lock"] == []  # nothing written


def unbatched(mode, params):
    return bare_labels(mode, params).unbatch()


def test_a_dataset_never_batched_is_named_as_such(tmp_path):
    estimator = trainer.Estimator(AucOnlyInEval(), str(tmp_path), global_batch_size=32)
    with pytest.raises(trainer.UserError) as error:
        estimator.train(unbatched, max_steps=1)
    assert str(error.value) == (
        "input_fn unbatched yields single examples (features {'x': [4]}, labels []), not "
        "batches: end it with .batch(params.batch_size)"
    )


def test_a_compiled_metric_named_by_a_string_keeps_that_name():
    """'auc' is reported as 'auc', as Keras reports it, whatever AUCs were made before."""
    from trainer.keras_model import KerasModel

    keras.metrics.AUC(), keras.metrics.AUC()  # Keras would count this model's as auc_2
    x = keras.Input((4,), name="x")
    model = keras.Model(x, keras.layers.Dense(1, "sigmoid")(x))
    model.compile("adam", "binary_crossentropy", metrics=["auc", "precision"])
    labels = {"y": tf.zeros([2, 1])}
    spec = KerasModel(model)({"x": tf.zeros([2, 4])}, labels, trainer.Mode.EVAL)
    assert sorted(spec.metrics) == ["auc", "precision"]


def test_a_saved_shuffle_buffer_larger_than_the_model_is_warned_of(tmp_path, caplog):
    """README's own input_fn over 20,000 examples: its 20,000-example shuffle buffer (5 MB
    of floats, more serialized) is saved in each checkpoint of a 5-weight model."""

    def wide(mode, params):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(20_000, 64)).astype("float32")
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, {"y": (x[:, 0] > 0) * 1}))
        return dataset.shuffle(20_000, seed=params.seed).repeat().batch(params.batch_size)

    class Wide(AucOnlyInEval):
        pass

    estimator = trainer.Estimator(Wide(), str(tmp_path), global_batch_size=32, progress=False)
    with caplog.at_level("WARNING"):
        estimator.train(wide, max_steps=5)
    warnings = [r.getMessage() for r in caplog.records if "saved state" in r.getMessage()]
    assert len(warnings) == 1, warnings
    size = re.match(r"The training input's saved state is (\d+) MB in each checkpoint", warnings[0])
    assert size and int(size.group(1)) >= 5, warnings[0]
    assert "held by its shuffle buffer (Dataset.shuffle): read the data by index" in warnings[0]


class WrongAucArgs(AucOnlyInEval):
    """The AUC named with its labels only: update_state(y_true) lacks y_pred."""

    def __call__(self, features, labels, mode):
        spec = super().__call__(features, labels, mode)
        if mode == trainer.Mode.EVAL:
            spec.metrics["auc"] = (self.auc, tf.cast(labels["y"], tf.float32))
        return spec


def test_a_streamed_metric_given_the_wrong_arguments_is_named_before_training(tmp_path):
    estimator = trainer.Estimator(WrongAucArgs(), str(tmp_path), global_batch_size=32)
    with pytest.raises(trainer.UserError) as error:
        estimator.train_and_evaluate(labelled_data, labelled_data, 40, eval_every_steps=20)
    assert str(error.value).startswith(
        "WrongAucArgs's metric 'auc' (AUC) cannot take the 1 value given with it (float32 [None]): "
    ), str(error.value)
    assert str(error.value).endswith(
        "name it as (metric, *update_state arguments), e.g. (metric, labels, predictions)"
    )
    assert estimator.step == 0 and not list(tmp_path.glob("ckpt-*"))


class MetricMadeInCall(AucOnlyInEval):
    def __call__(self, features, labels, mode):
        spec = super().__call__(features, labels, mode)
        if mode == trainer.Mode.EVAL:
            fresh = keras.metrics.AUC()  # made anew at each call: its state would be lost
            spec.metrics["auc"] = (
                fresh,
                tf.cast(labels["y"], tf.float32),
                spec.predictions["probability"],
            )
        return spec


def test_a_metric_made_in_call_is_named_not_blamed_on_the_features(tmp_path):
    estimator = trainer.Estimator(MetricMadeInCall(), str(tmp_path), global_batch_size=32)
    with pytest.raises(trainer.UserError) as error:
        estimator.train_and_evaluate(labelled_data, labelled_data, 40, eval_every_steps=20)
    assert str(error.value) == (
        "MetricMadeInCall makes new variables each time it is called (a Keras metric or layer "
        "created in __call__?): create it once, in __init__, and use it in __call__"
    )
    assert estimator.step == 0
