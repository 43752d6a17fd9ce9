"""Class weights, as Keras ``fit(class_weight=...)`` applies them: a map over the data.

``fit`` turns ``class_weight={0: 1.0, 1: 5.0}`` into a sample weight per example, read
from each example's label, before its step. Here the training input_fn does the same
in one line, and the model weighs its loss and weighted metrics by it as by any sample
weight::

    def input_fn(mode, params):
        dataset = ...batch(params.batch_size)
        if mode == trainer.Mode.TRAIN:  # fit applies class weights in training only
            dataset = dataset.map(trainer.class_weighted({0: 1.0, 1: 5.0}))
        return dataset

The map takes batches of ``(features, labels)`` (after ``batch``, as ``fit``'s adapter
maps them) and gives ``(features, labels, sample_weight)``: labels of class ids, of
shape ``[batch]`` or ``[batch, 1]``, or one-hot (their argmax); a class not named
weighs 1. As ``fit``, it refuses data that already has sample weights, and labels of
several outputs.
"""

from collections.abc import Callable, Mapping

import tensorflow as tf

from trainer.errors import KerasValueError


def class_weighted(class_weight: Mapping) -> Callable:
    """A function for ``dataset.map`` giving each batch the sample weights of its classes."""
    weights = _by_class(class_weight)
    table = tf.constant([weights.get(c, 1.0) for c in range(max(weights, default=-1) + 1)])

    @tf.autograph.experimental.do_not_convert  # plain TensorFlow calls; its refusals as raised
    def weighed(*element):
        if len(element) != 2:
            raise KerasValueError(
                f"class_weighted maps (features, labels), got an element of {len(element)} "
                "parts: as fit, it cannot join sample weights the data already has; weigh "
                "each example by its class in the input_fn's own sample weights"
            )
        features, labels = element
        if not tf.is_tensor(labels):
            raise KerasValueError(
                "class_weighted takes the labels of one output, got "
                f"{type(labels).__name__}: as fit, class weights are for a model of a "
                "single output; give the others sample weights by output"
            )
        return features, labels, tf.reshape(_weights_of(labels, table), [-1])

    return weighed


def _by_class(class_weight: Mapping) -> dict[int, float]:
    """``class_weight`` checked: a mapping of class ids (ints, or strings of them) to weights."""
    if not isinstance(class_weight, Mapping):
        raise KerasValueError(
            f"class_weight must map class ids to weights ({{0: 1.0, 1: 5.0}}), got "
            f"{type(class_weight).__name__}"
        )
    weights = {}
    for key, value in class_weight.items():
        try:
            weights[int(key)] = float(value)
        except (TypeError, ValueError):
            raise KerasValueError(
                f"class_weight's key {key!r} is not a class id: name each class by its integer "
                "index (its label)"
            ) from None
    return weights


def _weights_of(labels: tf.Tensor, table: tf.Tensor) -> tf.Tensor:
    """Each example's class weight: ids as they are, one-hot rows by their argmax."""
    if labels.shape.rank is not None and labels.shape.rank >= 2:
        classes = tf.cond(
            tf.shape(labels)[-1] > 1,
            lambda: tf.argmax(labels, axis=-1, output_type=tf.int32),
            lambda: tf.cast(tf.round(labels[..., 0]), tf.int32),
        )
    else:  # rank 1: class ids
        classes = tf.cast(tf.round(labels), tf.int32)
    if not table.shape[0]:  # no class named: every example weighs 1
        return tf.ones_like(classes, tf.float32)
    named = (classes >= 0) & (classes < tf.size(table))
    return tf.where(named, tf.gather(table, tf.clip_by_value(classes, 0, tf.size(table) - 1)), 1.0)
