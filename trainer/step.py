"""Compiled steps: one step function, and the compiled loops that call it.

Only this module touches the model during training. ``train_loop(iterator, n)`` runs
``n`` steps in one ``tf.function`` call so that per-call overhead is paid once per
block, not once per step; the Python loop in ``estimator.py`` picks ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from trainer.model_fn import Mode, ModelFn, Spec


def batch_size_of(features) -> tf.Tensor:
    """The number of examples in a batch of features, as a float64 scalar."""
    first = tf.nest.flatten(features)[0]
    return tf.cast(tf.shape(first)[0], tf.float64)


def split_element(element, mode: Mode):
    """Splits a dataset element into ``(features, labels)``; labels are None in PREDICT."""
    if isinstance(element, tuple) and len(element) == 2:
        features, labels = element
    else:
        features, labels = element, None
    return features, (None if mode == Mode.PREDICT else labels)


class MetricSums:
    """Streams the mean of the loss and of every per-example metric.

    Sums are kept in float64 variables so that means over large eval sets are exact
    to float32 precision; ``result`` reads them, ``reset`` zeroes them.
    """

    def __init__(self, names: Sequence[str]):
        self.names = ["loss", *names]
        with tf.init_scope():
            self.sums = {
                n: tf.Variable(0.0, dtype=tf.float64, trainable=False, name=f"sum_{n}")
                for n in self.names
            }
            self.count = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="count")

    def update(self, spec: Spec, batch_size: tf.Tensor) -> None:
        """Adds one batch: the loss weighted by batch size, metrics summed over examples."""
        self.sums["loss"].assign_add(tf.cast(spec.loss, tf.float64) * batch_size)
        for name in self.names[1:]:
            self.sums[name].assign_add(tf.reduce_sum(tf.cast(spec.metrics[name], tf.float64)))
        self.count.assign_add(batch_size)

    def result(self) -> dict[str, float]:
        """The mean of each value since the last reset (empty if nothing was added)."""
        count = float(self.count.numpy())
        if count == 0:
            return {}
        return {n: float(self.sums[n].numpy()) / count for n in self.names}

    def reset(self) -> None:
        """Zeroes every sum and the count."""
        for v in [*self.sums.values(), self.count]:
            v.assign(tf.zeros_like(v))


class Steps:
    """The compiled train, eval and predict functions of one model and optimizer."""

    def __init__(
        self,
        model_fn: ModelFn,
        optimizer: keras.optimizers.Optimizer,
        global_step: tf.Variable,
        metric_names: Sequence[str],
    ):
        self.model_fn = model_fn
        self.optimizer = optimizer
        self.global_step = global_step
        self.variables = model_fn.trainable_variables
        self.train_metrics = MetricSums(metric_names)
        self.eval_metrics = MetricSums(metric_names)
        with tf.init_scope():
            self.nonfinite = tf.Variable(False, trainable=False, name="nonfinite")
        self.train_loop = tf.function(self._train_loop)
        self.evaluate = tf.function(self._evaluate)
        self.predict = tf.function(self._predict)

    def _train_step(self, features, labels) -> tf.Tensor:
        """One step; returns False, and changes nothing, if loss or gradients are not finite.

        The gradients are checked too: a NaN input can leave the loss finite (ReLU maps
        NaN to 0 on some kernels) while the gradients that reach the weights are NaN.
        """
        with tf.GradientTape() as tape:
            spec = self.model_fn(features, labels, Mode.TRAIN)
        gradients = tape.gradient(spec.loss, self.variables)
        finite = tf.math.is_finite(spec.loss) & tf.math.is_finite(
            tf.linalg.global_norm([g for g in gradients if g is not None])
        )
        if finite:
            self.optimizer.apply_gradients(
                [(g, v) for g, v in zip(gradients, self.variables, strict=True) if g is not None]
            )
            self.train_metrics.update(spec, batch_size_of(features))
            self.global_step.assign_add(1)
        return finite

    def _train_loop(self, iterator, num_steps: tf.Tensor) -> None:
        """Runs up to ``num_steps`` steps; stops early, setting ``nonfinite``, on a bad loss."""
        self.nonfinite.assign(False)
        for _ in tf.range(num_steps):
            features, labels = split_element(next(iterator), Mode.TRAIN)
            if not self._train_step(features, labels):
                self.nonfinite.assign(True)
                break

    def _evaluate(self, dataset: tf.data.Dataset) -> None:
        for element in dataset:
            features, labels = split_element(element, Mode.EVAL)
            spec = self.model_fn(features, labels, Mode.EVAL)
            self.eval_metrics.update(spec, batch_size_of(features))

    def _predict(self, features):
        return dict(self.model_fn(features, None, Mode.PREDICT).predictions)
