"""A loss accounting is a plug-in: a loss type, its accounting, one row of ``trace.KINDS``.

The kind added here scores a pair of answers (a preference loss, ``-log sigmoid(chosen -
rejected)``) and reports its reward accuracy; nothing in the steps is told of it. Its
gradients under micro-batches equal plain gradient descent on the whole batch's loss,
written here in TF, and evaluation reports its accuracy over the whole set.
"""

from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from trainer import trace
from trainer.accounting import Examples
from trainer.settings import Checkpoints, Optimization


class Preference(NamedTuple):
    """Each example's score of its chosen and of its rejected answer, ``[batch]``."""

    chosen: tf.Tensor
    rejected: tf.Tensor

    def check(self, where: str) -> None:
        if self.chosen.shape.rank != 1 or self.rejected.shape.rank != 1:
            raise ValueError(f"{where}: Spec.loss is a Preference of one score per example")


class Pairs(Examples):
    """A preference loss, a mean over examples, with each example's reward accuracy."""

    @classmethod
    def of(cls, loss: Preference, padded):
        return cls(padded)

    def names(self, metrics, scalars, training):
        names, per_batch = super().names(metrics, scalars, training)
        return [*names, "reward_accuracy"], per_batch

    def split(self, given):
        return tf.reduce_mean(tf.math.softplus(given.rejected - given.chosen)), None

    def reported(self, given, added, features):
        return self.padding(features), self.evaluated(given, added)

    def evaluated(self, given, added):
        return {"reward_accuracy": tf.cast(given.chosen > given.rejected, tf.float32)}


class Scorer(trainer.ModelFn):
    def __init__(self):
        super().__init__()
        self.score = keras.layers.Dense(1, kernel_initializer="ones")

    def __call__(self, features, labels, mode):
        chosen = self.score(features["chosen"])[:, 0]
        rejected = self.score(features["rejected"])[:, 0]
        spec = {"chosen": chosen}
        if labels is None:
            return trainer.Spec(spec)
        return trainer.Spec(spec, loss=Preference(chosen, rejected))


def test_a_new_loss_kind_plugs_in_by_a_row_of_kinds(tmp_path, monkeypatch):
    monkeypatch.setitem(trace.KINDS, Preference, Pairs.of)
    rng = np.random.default_rng(0)
    chosen = rng.normal(size=(32, 4)).astype("float32")
    rejected = rng.normal(size=(32, 4)).astype("float32")
    labels = np.zeros(32, "float32")
    estimator = trainer.Estimator(
        Scorer(),
        str(tmp_path),
        optimizer=keras.optimizers.SGD(0.5),
        global_batch_size=16,
        steps_per_loop=2,
        optimization=Optimization(microbatches=2),
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )

    def input_fn(mode, params):
        features = {"chosen": chosen, "rejected": rejected}
        dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(16)
        return dataset.repeat() if mode == trainer.Mode.TRAIN else dataset

    estimator.train(input_fn, 2)

    kernel, bias = tf.Variable(tf.ones([4, 1])), tf.Variable(tf.zeros([1]))
    for step in range(2):  # the whole batch's mean loss, descended as SGD does
        batch = slice(16 * step, 16 * step + 16)
        with tf.GradientTape() as tape:
            margin = (chosen[batch] - rejected[batch]) @ kernel
            loss = tf.reduce_mean(tf.math.softplus(-margin))
        for variable, grad in zip((kernel, bias), tape.gradient(loss, [kernel, bias]), strict=True):
            variable.assign_sub(0.5 * (grad if grad is not None else tf.zeros_like(variable)))
    trained = estimator.model.model_fn.score.kernel.numpy()
    np.testing.assert_allclose(trained, kernel.numpy(), rtol=1e-5)

    evaluated = estimator.evaluate(input_fn)
    margins = ((chosen - rejected) @ kernel.numpy())[:, 0]
    assert evaluated["reward_accuracy"] == pytest.approx(np.mean(margins > 0))
    assert evaluated["loss"] == pytest.approx(np.mean(np.logaddexp(0.0, -margins)), rel=1e-5)


def test_a_loss_of_its_own_kind_checks_itself_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(trace.KINDS, Preference, Pairs.of)

    class Unscored(Scorer):
        def __call__(self, features, labels, mode):
            scores = self.score(features["chosen"])
            return trainer.Spec({"scores": scores}, loss=Preference(scores, scores))

    estimator = trainer.Estimator(Unscored(), str(tmp_path), global_batch_size=4, progress=False)

    def input_fn(mode, params):
        features = {"chosen": np.ones((8, 4), "float32")}
        return tf.data.Dataset.from_tensor_slices((features, np.zeros(8))).batch(4).repeat()

    with pytest.raises(trainer.UserError, match="Preference of one score per example"):
        estimator.train(input_fn, 1)
