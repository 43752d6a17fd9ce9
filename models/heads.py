"""Turn a model's outputs into a Spec: the loss, predictions and metrics of a task."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from models import ops
from trainer import Spec, UserError
from trainer.model_fn import check_class_ids


@tf.autograph.experimental.do_not_convert
def classification(
    logits: tf.Tensor,
    labels: dict | None,
    label_key: str = "label",
    top_k_errors: Sequence[int] = (),
    label_smoothing: float = 0.0,
) -> Spec:
    """Softmax classification over the last axis of ``logits``.

    Predictions are ``classes`` and ``probabilities``; with labels, the loss is the
    mean cross-entropy (computed from logits, so it is stable for large logits) and
    ``accuracy`` is reported per example, with ``top_K_error`` for each K of
    ``top_k_errors`` (ImageNet's table gives top-1 and top-5 error).

    ``labels[label_key]`` holds class ids, or one distribution over the classes per
    example (``[batch, classes]``: one-hot, or MixUp's and CutMix's mixed labels),
    scored against its most likely class. ``label_smoothing`` mixes the target with
    the uniform distribution, ``(1 - s) * target + s / classes``, as Keras's
    ``CategoricalCrossentropy(label_smoothing=s)``; it changes the loss, not the metrics.
    """
    logits = tf.cast(logits, tf.float32)
    predictions = {
        "classes": tf.argmax(logits, axis=-1, output_type=tf.int64),
        "probabilities": tf.nn.softmax(logits),
    }
    if labels is None:
        return Spec(predictions)
    classes = logits.shape[-1]
    target = labels[label_key]
    if target.dtype.is_floating and target.shape.rank == 2 and target.shape[-1] != classes:
        raise UserError(
            f"labels[{label_key!r}] holds distributions over {target.shape[-1]} classes where "
            f"the model has {classes}: is mixing.num_classes the model's num_classes?"
        )
    if is_distribution(target, classes):
        target = check_distribution(target, label_key)
        label = tf.argmax(target, axis=-1, output_type=tf.int64)
    else:
        label = check_class_ids(target, classes, label_key, hint="; is num_classes right?")
        target = tf.one_hot(label, classes) if label_smoothing else None
    if target is None:
        cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label, logits=logits)
    else:
        if label_smoothing:
            target = target * (1.0 - label_smoothing) + label_smoothing / classes
        cross_entropy = tf.nn.softmax_cross_entropy_with_logits(labels=target, logits=logits)
    correct = tf.cast(tf.equal(predictions["classes"], label), tf.float32)
    metrics = {"accuracy": correct}
    for k in top_k_errors:
        metrics[f"top_{k}_error"] = ops.top_k_error(label, logits, k)
    return Spec(predictions, loss=tf.reduce_mean(cross_entropy), metrics=metrics)


@tf.autograph.experimental.do_not_convert
def is_distribution(target: tf.Tensor, classes: int) -> bool:
    """Whether a label tensor holds one distribution over ``classes`` per example."""
    return (
        target.dtype.is_floating
        and target.shape.rank == 2
        and classes > 1
        and target.shape[-1] == classes
    )


@tf.autograph.experimental.do_not_convert
def check_distribution(target: tf.Tensor, what: str) -> tf.Tensor:
    """``target`` (float32), once each row is checked to be >= 0 and to sum to 1."""
    target = tf.cast(target, tf.float32)
    sums = tf.reduce_sum(target, axis=-1)
    valid = tf.reduce_all(target >= 0.0, axis=-1) & (tf.abs(sums - 1.0) < 1e-3)
    check = tf.debugging.Assert(
        tf.reduce_all(valid),
        [f"{what} holds class probabilities that are not a distribution; row sums", sums],
        summarize=8,
    )
    with tf.control_dependencies([check]):
        return tf.identity(target)
