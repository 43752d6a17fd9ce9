"""Turn a model's outputs into a Spec: the loss, predictions and metrics of a task."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from models import ops
from trainer import Spec
from trainer.model_fn import check_class_ids


def classification(
    logits: tf.Tensor,
    labels: dict | None,
    label_key: str = "label",
    top_k_errors: Sequence[int] = (),
) -> Spec:
    """Softmax classification over the last axis of ``logits``.

    Predictions are ``classes`` and ``probabilities``; with labels, the loss is the
    mean cross-entropy (computed from logits, so it is stable for large logits) and
    ``accuracy`` is reported per example, with ``top_K_error`` for each K of
    ``top_k_errors`` (ImageNet's table gives top-1 and top-5 error).
    """
    logits = tf.cast(logits, tf.float32)
    predictions = {
        "classes": tf.argmax(logits, axis=-1, output_type=tf.int64),
        "probabilities": tf.nn.softmax(logits),
    }
    if labels is None:
        return Spec(predictions)
    label = check_class_ids(
        labels[label_key], logits.shape[-1], label_key, hint="; is num_classes right?"
    )
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label, logits=logits)
    correct = tf.cast(tf.equal(predictions["classes"], label), tf.float32)
    metrics = {"accuracy": correct}
    for k in top_k_errors:
        metrics[f"top_{k}_error"] = ops.top_k_error(label, logits, k)
    return Spec(predictions, loss=tf.reduce_mean(cross_entropy), metrics=metrics)
