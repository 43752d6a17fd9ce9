"""Compiled steps: one step function, and the compiled loops that call it.

Only this module touches the model during training. ``train_loop(iterator, n)`` runs
``n`` steps in one ``tf.function`` call so that per-call overhead is paid once per
block, not once per step; the Python loop in ``estimator.py`` picks ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from trainer.model_fn import Mode, ModelFn
from trainer.optimization import WeightAverage


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
    """Streams means: of per-example metrics over examples, of per-batch values over batches.

    Per-batch values (the loss, the gradient norm) are weighted by batch size, so
    with a short last batch every example still counts once. Sums are float64
    variables; ``result`` reads them, ``reset`` zeroes them.
    """

    def __init__(self, per_example: Sequence[str], per_batch: Sequence[str] = ("loss",)):
        self.per_example = list(per_example)
        self.per_batch = list(per_batch)
        with tf.init_scope():
            self.sums = {
                n: tf.Variable(0.0, dtype=tf.float64, trainable=False, name=f"sum_{n}")
                for n in self.per_batch + self.per_example
            }
            self.count = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="count")

    def update(self, per_example, per_batch, batch_size: tf.Tensor) -> None:
        """Adds one batch: dicts of ``[batch]`` values and of scalars."""
        for name in self.per_batch:
            self.sums[name].assign_add(tf.cast(per_batch[name], tf.float64) * batch_size)
        for name in self.per_example:
            self.sums[name].assign_add(tf.reduce_sum(tf.cast(per_example[name], tf.float64)))
        self.count.assign_add(batch_size)

    def result(self) -> dict[str, float]:
        """The mean of each value since the last reset (empty if nothing was added)."""
        count = float(self.count.numpy())
        if count == 0:
            return {}
        return {n: float(v.numpy()) / count for n, v in self.sums.items()}

    def reset(self) -> None:
        """Zeroes every sum and the count."""
        for v in [*self.sums.values(), self.count]:
            v.assign(tf.zeros_like(v))


class Steps:
    """The compiled train, eval and predict functions of one model and optimizer.

    Args:
      model_fn: the model.
      optimizer: a built Keras optimizer.
      global_step: incremented once per applied training step.
      metric_names: the per-example metrics the model's Spec returns.
      clip_gradient_norm: clip gradients to this global norm (None: no clipping).
      ema: a WeightAverage to update after each step, or None.
      jit_compile: compile the step with XLA (the loop around it stays a TF loop, since
        iterator ops cannot be compiled).
    """

    def __init__(
        self,
        model_fn: ModelFn,
        optimizer: keras.optimizers.Optimizer,
        global_step: tf.Variable,
        metric_names: Sequence[str],
        clip_gradient_norm: float | None = None,
        ema: WeightAverage | None = None,
        jit_compile: bool = False,
    ):
        self.model_fn = model_fn
        self.optimizer = optimizer
        self.global_step = global_step
        self.clip_gradient_norm = clip_gradient_norm
        self.ema = ema
        self.variables = model_fn.trainable_variables
        self.has_regularization = bool(model_fn.regularization_losses)
        train_scalars = ["loss", "gradient_norm"]
        if self.has_regularization:
            train_scalars.append("regularization_loss")
        self.train_metrics = MetricSums(metric_names, train_scalars)
        self.eval_metrics = MetricSums(metric_names)
        with tf.init_scope():
            self.nonfinite = tf.Variable(False, trainable=False, name="nonfinite")
        if jit_compile:
            self._train_step = tf.function(self._train_step, jit_compile=True)
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
            scalars = {"loss": spec.loss}
            total = spec.loss
            if self.has_regularization:
                scalars["regularization_loss"] = tf.add_n(self.model_fn.regularization_losses)
                total = total + scalars["regularization_loss"]
        pairs = [
            (g, v)
            for g, v in zip(tape.gradient(total, self.variables), self.variables, strict=True)
            if g is not None
        ]
        gradients = [g for g, _ in pairs]
        scalars["gradient_norm"] = tf.linalg.global_norm(gradients)
        finite = tf.math.is_finite(total) & tf.math.is_finite(scalars["gradient_norm"])
        if finite:
            if self.clip_gradient_norm:
                gradients, _ = tf.clip_by_global_norm(
                    gradients, self.clip_gradient_norm, use_norm=scalars["gradient_norm"]
                )
            self.optimizer.apply_gradients(zip(gradients, [v for _, v in pairs], strict=True))
            if self.ema is not None:
                self.ema.update()
            self.train_metrics.update(spec.metrics, scalars, batch_size_of(features))
            self.global_step.assign_add(1)
        return finite

    def _train_loop(self, iterator, num_steps: tf.Tensor) -> None:
        """Runs up to ``num_steps`` steps; stops early, setting ``nonfinite``, on a bad step."""
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
            self.eval_metrics.update(spec.metrics, {"loss": spec.loss}, batch_size_of(features))

    def _predict(self, features):
        return dict(self.model_fn(features, None, Mode.PREDICT).predictions)
