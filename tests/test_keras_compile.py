"""What a Keras user gives compile() is honoured as Keras fit honours it, or refused in one line.

The models are compiled the ways Keras users compile them, and the data is yielded as
Keras users yield it: ``(features, labels, sample_weight)`` from arrays.
"""

import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from tests.support.compiled_keras import BATCH, STEPS, compiled, digits_arrays, weighted_input_fn
from tests.support.helpers import on_two_cpus
from trainer.errors import first_line


def keras_dataset(repeat):
    x, y, w = digits_arrays()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, w))
    return (dataset.repeat() if repeat else dataset).batch(BATCH)


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size", "mean_with_sample_weight"])
def test_loss_reduction_and_weighted_metrics_end_as_keras_fit_ends(tmp_path, reduction):
    """Same data, batches, seed and sample weights: the same weights, loss and metrics."""

    def make():
        return compiled(
            keras.losses.BinaryCrossentropy(reduction=reduction),
            metrics=["accuracy"],
            weighted_metrics=["accuracy", keras.metrics.AUC(name="auc")],
        )

    theirs = make()
    theirs.fit(
        keras_dataset(repeat=True), steps_per_epoch=STEPS, epochs=1, verbose=0, shuffle=False
    )
    expected = theirs.evaluate(keras_dataset(repeat=False), return_dict=True, verbose=0)

    ours = make()
    estimator = trainer.Estimator(
        ours, str(tmp_path), global_batch_size=BATCH, steps_per_loop=10, progress=False
    )
    estimator.train(weighted_input_fn, max_steps=STEPS)
    result = estimator.evaluate(weighted_input_fn)

    for mine, keras_weights in zip(ours.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_allclose(mine, keras_weights, rtol=1e-4, atol=1e-5)
    assert sorted(expected) == ["accuracy", "auc", "loss", "weighted_accuracy"]
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, rel=1e-4), name
    # Weighted and plain accuracy differ, so the weights were applied, not dropped.
    assert abs(result["weighted_accuracy"] - result["accuracy"]) > 1e-3
    if reduction == "sum":  # a sum over 64 examples, not their mean
        assert result["loss"] > 10


@pytest.mark.slow
def test_a_sum_reduced_loss_is_summed_over_the_whole_step_on_two_devices(tmp_path):
    """Towers and mirrored replicas train what one device trains with reduction='sum'."""
    runs = on_two_cpus("tests.support.compiled_keras", "sum_reduced_runs", str(tmp_path))
    one = runs.pop("auto")
    assert one["loss"] > 10  # the sum over a batch of 64, not the mean
    for distribution, run in runs.items():
        for a, b in zip(one["weights"], run["weights"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=distribution)
        assert run["loss"] == pytest.approx(one["loss"], rel=1e-4), distribution


class OwnStep(keras.Model):
    """A subclassed model with its own train_step, as Keras's GAN example writes one."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1, activation="sigmoid")

    def call(self, image):
        return self.dense(image)

    def test_step(self, data):
        return {}


def refusal(model, tmp_path, input_fn=weighted_input_fn):
    """The line a refused model gets, with nothing written to its model_dir."""
    model_dir = tmp_path / "run"
    with pytest.raises(trainer.UserError) as refused:
        estimator = trainer.Estimator(model, str(model_dir), global_batch_size=BATCH)
        estimator.train(input_fn, max_steps=2)
    assert not model_dir.exists() or sorted(os.listdir(model_dir)) == []
    return first_line(refused.value)  # the line the command line prints


def test_what_compile_gives_that_cannot_be_honoured_is_refused_in_one_line(tmp_path):
    model = OwnStep()
    model.compile(loss="binary_crossentropy")
    assert refusal(model, tmp_path) == (
        "Keras model 'own_step' overrides test_step, which the framework never calls (it "
        "evaluates with the model's call and its compiled loss and metrics): write it as a "
        "trainer.ModelFn, or use model.fit"
    )

    unreduced = compiled(keras.losses.BinaryCrossentropy(reduction=None))
    assert refusal(unreduced, tmp_path).endswith(
        "loss 'binary_crossentropy' has reduction=None, which leaves a value per example "
        "for Keras to add up unsaid: give it reduction='sum' or 'sum_over_batch_size' (the mean)"
    )

    auc = keras.metrics.AUC(name="auc")
    shared = compiled("binary_crossentropy", metrics=[auc], weighted_metrics=[auc])
    assert refusal(shared, tmp_path).endswith(
        "one AUC object, 'auc', is given for 'output' and again for 'output': it would add "
        "both up in one state; give each place its own metric object"
    )


class Branching(keras.Model):
    """A subclassed model whose call branches in Python on a tensor."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1, activation="sigmoid")

    def call(self, image):
        if tf.reduce_sum(image) > 0:  # fit cannot run this either
            return self.dense(image)
        return self.dense(-image)


def test_a_python_branch_on_a_tensor_is_named_in_one_line(tmp_path):
    model = Branching()
    model.compile(loss="binary_crossentropy")
    assert refusal(model, tmp_path).endswith(
        "uses a tensor as a Python bool (an if or while on a tensor), which a compiled step "
        "cannot run (nor can Keras fit): write it with tf.cond or tf.where (keras.ops.cond, "
        "keras.ops.where)"
    )


def test_a_model_fn_giving_one_metric_object_under_two_names_is_refused(tmp_path):
    class TwoNames(trainer.ModelFn):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.auc = keras.metrics.AUC()

        def __call__(self, features, labels, mode):
            logit = self.dense(features["image"])[:, 0]
            if labels is None:
                return trainer.Spec({"logit": logit})
            y = labels.labels if isinstance(labels, tuple) else labels
            loss = tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logit)
            p = tf.sigmoid(logit)
            metrics = {"auc": (self.auc, y, p), "auc_again": (self.auc, y, p)}
            return trainer.Spec({"logit": logit}, tf.reduce_mean(loss), metrics)

    def unweighted(mode, params):
        return weighted_input_fn(mode, params).map(lambda x, y, w: (x, y))

    assert refusal(TwoNames(), tmp_path, unweighted) == (
        "TwoNames gives one AUC object as metric 'auc' and as 'auc_again': both would add up "
        "in one state; make one metric object for each"
    )


def test_sample_weights_reach_only_a_model_that_takes_them(tmp_path):
    class Plain(trainer.ModelFn):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def __call__(self, features, labels, mode):
            logit = self.dense(features["image"])[:, 0]
            loss = tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit)
            return trainer.Spec({"logit": logit}, tf.reduce_mean(loss))

    assert refusal(Plain(), tmp_path) == (
        "the input_fn yields (features, labels, sample_weight), and Plain takes no sample "
        "weights (a compiled Keras model does): yield (features, labels) with the weights "
        "as a feature or label, and weight the loss in the model"
    )


def test_the_log_says_which_optimizer_trains_and_what_of_compile_is_not_used(tmp_path, caplog):
    model = compiled("binary_crossentropy", steps_per_execution=8)
    with caplog.at_level(logging.INFO):
        estimator = trainer.Estimator(
            model,
            str(tmp_path),
            global_batch_size=BATCH,
            optimizer=keras.optimizers.Adam(1e-3),
            progress=False,
        )
    said = caplog.text
    assert (
        f"Training Keras model {model.name!r} with the optimizer given to the Estimator "
        "(Estimator.optimizer in gin), Adam, not the SGD given to compile()"
    ) in said
    assert (
        "compile()'s steps_per_execution=8 is not used: Estimator.steps_per_loop decides it" in said
    )
    assert isinstance(estimator.optimizer, keras.optimizers.Adam)
    # Given no optimizer, compile()'s trains, and nothing is said of it.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        plain = trainer.Estimator(compiled("binary_crossentropy"), str(tmp_path / "b"))
    assert isinstance(plain.optimizer, keras.optimizers.SGD) and "optimizer" not in caplog.text


def test_a_metric_of_one_number_per_class_is_refused_before_training(tmp_path):
    """F1Score() without an average gives one number per class, which fit logs as an
    array; the framework logs and ranks numbers, so it says so before the first step
    (it said it at the first evaluation, mid-training)."""
    x, y, _ = digits_arrays()
    labels = keras.ops.one_hot((y * 3).astype("int32"), 4)  # 4 classes, one-hot

    def input_fn(mode, params):
        return tf.data.Dataset.from_tensor_slices(({"image": x}, labels)).repeat().batch(8)

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,), name="image"), keras.layers.Dense(4, activation="softmax")]
    )
    model.compile("sgd", "categorical_crossentropy", metrics=[keras.metrics.F1Score()])
    estimator = trainer.Estimator(model, str(tmp_path), global_batch_size=8, progress=False)
    with pytest.raises(trainer.UserError) as refused:
        estimator.train_and_evaluate(input_fn, input_fn, 20, eval_every_steps=10, eval_steps=2)
    assert str(refused.value).startswith(
        "metric 'f1_score' (F1Score) has a result of shape [4]: report one number"
    ), refused.value
    assert estimator.step == 0 and not (tmp_path / "checkpoint").exists()
