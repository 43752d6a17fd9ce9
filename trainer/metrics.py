"""What a metric is, how it is checked, and how it is summed over batches, devices, workers.

A Spec's metrics (``Spec.metrics``) are of two kinds:

* per-example values, a ``[batch]`` tensor or ``(values, weights)``: the framework
  streams their (weighted) mean in float64 sums, in training and evaluation alike;
* streamed metrics, ``(keras.metrics.Metric, *update_state args)`` (AUC, precision),
  which keep their own state: summed over the eval set, and in training over each
  epoch of the callbacks (``EpochMetrics``, as fit's epoch logs have them).

Here: ``check_metric`` (part of ``model_fn.check_spec``), ``split_metrics`` into the
two kinds, ``unfit_metric`` (a streamed metric's ``update_state`` traced before
training, so a mistake is said at once) and ``MetricSums``, the sums a mode's steps
add to (``Steps.take_metrics`` makes them for each mode once the model was traced
in it, ``ModelState.build``), read by ``result`` and zeroed by ``reset`` before each
evaluation. Under a strategy the sums, and the Keras metrics' state
(``Placement.adopt_metrics``), are kept per replica and added up when read.
``keras_model`` turns compile()'s metrics into these two kinds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from trainer import errors
from trainer.errors import UserError


@tf.autograph.experimental.do_not_convert
def check_metric(where: str, name: str, value) -> None:
    """Refuses a metric that is neither kind (ValueError, which check_spec raises).

    Or that has the loss's name: its figure would replace the loss's where both are
    reported (a streamed 'loss' of 0.754 stood where the model's loss was 2.264).
    """
    if name in ("loss", "regularization_loss"):
        raise ValueError(f"{where}: metric name {name!r} is reserved for Spec.loss")
    if is_streamed(value):
        return  # streamed: its update_state takes what it takes
    weighted = isinstance(value, tuple) and len(value) == 2 and all(map(tf.is_tensor, value))
    if isinstance(value, tuple | list) and not weighted:
        raise ValueError(
            f"{where}: metric {name!r} is a {type(value).__name__} whose first item is "
            f"{type(value[0]).__name__ if value else 'missing'}; give a tensor of "
            "per-example values, (values, weights), or (keras.metrics.Metric, "
            "*update_state args)"
        )
    for tensor in value if weighted else [value]:
        if tensor.shape.rank != 1:
            raise ValueError(
                f"{where}: metric {name!r} must hold one value per example (shape [batch]), "
                f"got shape {tensor.shape}"
            )


@tf.autograph.experimental.do_not_convert
def split_metrics(metrics: Mapping) -> tuple[dict, dict]:
    """``(per-example values, streamed (metric, *args) tuples)`` of a Spec's metrics.

    A per-example metric is a ``[batch]`` tensor or a ``(values, weights)`` pair.
    """
    streamed = {n: v for n, v in metrics.items() if is_streamed(v)}
    return {n: v for n, v in metrics.items() if n not in streamed}, streamed


@tf.autograph.experimental.do_not_convert
def is_streamed(value) -> bool:
    """Whether a Spec's metric is a streamed ``(keras.metrics.Metric, *args)`` tuple."""
    return isinstance(value, tuple) and bool(value) and isinstance(value[0], keras.metrics.Metric)


@tf.autograph.experimental.do_not_convert
def unfit_metric(name: str, streamed: dict) -> str | None:
    """Why a streamed metric cannot take the values named with it, found while tracing.

    Its ``update_state`` is traced (never run) with them, so that a mistake is said
    before training rather than at the first evaluation.
    """
    names: dict[int, str] = {}
    for metric_name, (metric, *args) in streamed.items():
        if id(metric) in names:
            return (
                f"{name} gives one {type(metric).__name__} object as metric "
                f"{names[id(metric)]!r} and as {metric_name!r}: both would add up in one "
                "state; make one metric object for each"
            )
        names[id(metric)] = metric_name
        try:
            metric.update_state(*args)
        except (TypeError, ValueError) as error:
            given = ", ".join(f"{a.dtype.name} {a.shape.as_list()}" for a in args)
            count = f"{len(args)} value{'s' if len(args) != 1 else ''}"
            return (
                f"{name}'s metric {metric_name!r} ({type(metric).__name__}) cannot take the "
                f"{count} given with it ({given}): {errors.first_line(error)}; name it as "
                "(metric, *update_state arguments), e.g. (metric, labels, predictions)"
            )
        shape = metric.result().shape  # traced too: its static shape
        if shape.num_elements() is not None and shape.num_elements() > 1:
            return not_one_number(metric_name, metric, shape)
    return None


def not_one_number(name: str, metric: keras.metrics.Metric, shape) -> str:
    """Why a streamed metric whose result has several numbers cannot be logged or ranked."""
    return (
        f"metric {name!r} ({type(metric).__name__}) has a result of shape "
        f"{list(shape)}: report one number (e.g. F1Score(average='macro')), or "
        "one metric per class"
    )


def replica_sums(per_replica: bool) -> dict:
    """``tf.Variable`` options of a sum kept per replica and added up when read, if asked."""
    if not per_replica:
        return {}
    return dict(
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )


class MetricSums:
    """Streams means: of per-example metrics over examples, of per-batch values over batches.

    Per-batch values (the loss, the gradient norm) are weighted by batch size, so
    with a short last batch every example still counts once. A per-example metric
    given as ``(values, weights)`` is a weighted mean: each sum has its own
    denominator (the examples counted, or their weights). Sums are float64
    variables; ``result`` reads them, ``reset`` zeroes them. With ``per_replica``
    (updated inside ``strategy.run``) each replica keeps its own sums and reading
    adds them up over all replicas and workers.

    ``streamed`` metrics (``keras.metrics.Metric`` objects: AUC, precision) keep
    their own state, which ``stream`` updates; made in a strategy's scope, their
    variables are kept per replica and added up when read, as the sums are.
    """

    def __init__(
        self,
        per_example: Sequence[str],
        per_batch: Sequence[str] = ("loss",),
        per_replica: bool = False,
        streamed: Mapping[str, keras.metrics.Metric] | None = None,
    ):
        self.per_example = list(per_example)
        self.streamed = dict(streamed or {})
        self.per_batch = list(per_batch)
        sync = replica_sums(per_replica)
        with tf.init_scope():
            self.sums = {
                n: tf.Variable(0.0, dtype=tf.float64, trainable=False, name=f"sum_{n}", **sync)
                for n in self.per_batch + self.per_example
            }
            self.weights = {
                n: tf.Variable(0.0, dtype=tf.float64, trainable=False, name=f"weight_{n}", **sync)
                for n in self.per_example
            }
            self.count = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="count", **sync)

    @tf.autograph.experimental.do_not_convert
    def update(self, per_example, per_batch, batch_size: tf.Tensor) -> None:
        """Adds one batch: dicts of ``[batch]`` values and of scalars."""
        for name in self.per_batch:  # a replica's empty share of a last batch adds 0, not NaN
            value = tf.cast(per_batch[name], tf.float64) * tf.cast(batch_size, tf.float64)
            self.sums[name].assign_add(tf.where(batch_size > 0, value, tf.zeros_like(value)))
        for name in self.per_example:
            values = per_example[name]
            if isinstance(values, tuple):  # (values, weights): a weighted mean
                values, weights = (tf.cast(v, tf.float64) for v in values)
                total, weight = tf.reduce_sum(values * weights), tf.reduce_sum(weights)
            else:
                total = tf.reduce_sum(tf.cast(values, tf.float64))
                weight = tf.cast(tf.size(values), tf.float64)
            self.sums[name].assign_add(total)
            self.weights[name].assign_add(weight)
        self.count.assign_add(batch_size)

    @tf.autograph.experimental.do_not_convert
    def stream(self, streamed: Mapping[str, tuple]) -> None:
        """Updates each streamed metric: ``{name: (metric, *update_state args)}``."""
        for name, (metric, *args) in streamed.items():
            if name in self.streamed:
                metric.update_state(*args)

    def result(self) -> dict[str, float]:
        """The mean of each value since the last reset (empty if nothing was added)."""
        count = float(self.count.numpy())
        if count == 0:
            return {}
        means = {n: float(self.sums[n].numpy()) / count for n in self.per_batch}
        for n in self.per_example:
            weights = float(self.weights[n].numpy())
            # No weight at all (every token masked): 0, as Keras's divide_no_nan gives.
            means[n] = float(self.sums[n].numpy()) / weights if weights else 0.0
        return means | {n: _scalar(n, m) for n, m in self.streamed.items()}

    def reset(self) -> None:
        """Zeroes every sum and the count."""
        for v in [*self.sums.values(), *self.weights.values(), self.count]:
            v.assign(tf.zeros_like(v))
        for metric in self.streamed.values():
            metric.reset_state()


class EpochMetrics:
    """A training epoch's streamed metrics (AUC, F1), as ``fit``'s epoch logs have them.

    Training updates copies of the Spec's metric objects (``training_copies``), so
    that an evaluation, which resets and fills the originals, leaves the epoch's
    state alone. The callbacks read them at each epoch's end and reset them then
    (``trainer.callbacks``); a resumed epoch counts from its resumed step. Made in a
    strategy's scope, their state is kept per replica and added up when read.
    """

    def __init__(self, metrics: Mapping[str, keras.metrics.Metric] | None = None):
        self.metrics = dict(metrics or {})

    @tf.autograph.experimental.do_not_convert
    def stream(self, streamed: Mapping[str, tuple]) -> None:
        """Updates each copy with what the Spec names its metric with."""
        for name, (_, *args) in streamed.items():
            if name in self.metrics:
                self.metrics[name].update_state(*args)

    def result(self) -> dict[str, float]:
        """Each metric's value since the last reset (under workers, a collective)."""
        return {n: _scalar(n, m) for n, m in self.metrics.items()}

    def reset(self) -> None:
        """Zeroes each metric's state: an epoch begins."""
        for metric in self.metrics.values():
            metric.reset_state()


def specs_of(args) -> list:
    """The ``tf.TensorSpec`` of each tensor in ``args`` (other values as they are)."""
    return tf.nest.map_structure(
        lambda a: tf.TensorSpec.from_tensor(a) if tf.is_tensor(a) else a, list(args)
    )


def training_copies(
    metrics: Mapping[str, keras.metrics.Metric], specs: Mapping[str, list]
) -> dict[str, keras.metrics.Metric]:
    """A new metric of each one's config, for training, built before the step is traced.

    Each is built by tracing (never running) its ``update_state`` with arguments of
    ``specs`` (the Spec's, by name), as evaluation's were.

    A metric that cannot be made again from its config (a user's subclass without
    ``get_config``) is left out: it is evaluated only, and the log says so.
    """
    copies = {}
    for name, metric in metrics.items():
        try:
            copy = type(metric).from_config(metric.get_config())
            tf.function(copy.update_state).get_concrete_function(*specs[name])
        except (TypeError, ValueError, NotImplementedError) as error:
            logging.warning(
                "metric %r (%s) is evaluated only, not in training's epoch logs: it cannot be "
                "made again from its get_config() (%s)",
                name,
                type(metric).__name__,
                errors.first_line(error),
            )
            continue
        copies[name] = copy
    return copies


def _scalar(name: str, metric: keras.metrics.Metric) -> float:
    """A streamed metric's result, which must be one number to be logged and ranked."""
    value = metric.result()
    if getattr(value, "shape", None) is not None and int(np.prod(value.shape)) == 1:
        return float(np.reshape(value, ()))  # F1Score() of a binary classifier: [1]
    if len(getattr(value, "shape", ())) > 0:
        raise UserError(not_one_number(name, metric, value.shape))
    return float(value)
