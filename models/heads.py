"""Turn a model's outputs into a Spec: the loss, predictions and metrics of a task."""

from __future__ import annotations

import tensorflow as tf

from trainer import Spec


def classification(logits: tf.Tensor, labels: dict | None, label_key: str = "label") -> Spec:
    """Softmax classification over the last axis of ``logits``.

    Predictions are ``classes`` and ``probabilities``; with labels, the loss is the
    mean cross-entropy (computed from logits, so it is stable for large logits) and
    ``accuracy`` is reported per example.
    """
    logits = tf.cast(logits, tf.float32)
    predictions = {
        "classes": tf.argmax(logits, axis=-1, output_type=tf.int64),
        "probabilities": tf.nn.softmax(logits),
    }
    if labels is None:
        return Spec(predictions)
    label = tf.cast(labels[label_key], tf.int64)
    num_classes = logits.shape[-1]
    checks = [
        tf.debugging.assert_non_negative(label, message=f"{label_key} below 0"),
        tf.debugging.assert_less(
            label,
            tf.constant(num_classes, tf.int64),
            message=f"{label_key} out of range [0, {num_classes}): is num_classes right?",
        ),
    ]
    with tf.control_dependencies(checks):  # run the checks before the loss uses the label
        label = tf.identity(label)
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label, logits=logits)
    correct = tf.cast(tf.equal(predictions["classes"], label), tf.float32)
    return Spec(predictions, loss=tf.reduce_mean(cross_entropy), metrics={"accuracy": correct})
