"""How a Spec's loss is weighted over a batch's shards and reported.

A Spec's ``loss`` is the mean over the examples its model was called on (or their
sum, ``loss_reduction='sum'``), one loss or a dict of one per optimizer group. The
steps weight it by each shard's share of the batch; what is reported is ``loss`` (the
one loss, or the groups' sum), each group's as ``<group>_loss`` and the Spec's scalars.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import tensorflow as tf

from trainer.model_fn import Spec, Weighted


@tf.autograph.experimental.do_not_convert
def batch_size_of(features) -> tf.Tensor:
    """The number of examples in a batch of features, as a float64 scalar."""
    first = tf.nest.flatten(features)[0]
    return tf.cast(tf.shape(first)[0], tf.float64)


@tf.autograph.experimental.do_not_convert
def batch_loss(spec: Spec, shard: tf.Tensor, examples: Callable[[], tf.Tensor]):
    """A Spec's loss as the framework weights it: the mean over ``shard``'s examples.

    A loss summed over the batch (``loss_reduction='sum'``) is the sum over the
    ``examples()`` of the whole step, over devices and replicas: the shard's sum
    times ``examples / shard``, so that the shards' mean weighted by their size is
    the sum over all (an empty shard's is 0). A dict of losses, one per group, is
    weighted loss by loss.
    """
    if spec.loss_reduction != "sum":
        return dict(spec.loss) if isinstance(spec.loss, Mapping) else spec.loss
    scale = tf.math.divide_no_nan(examples(), shard)
    return tf.nest.map_structure(lambda loss: loss * tf.cast(scale, loss.dtype), spec.loss)


@tf.autograph.experimental.do_not_convert
def with_mean_weight(labels, total: Callable):
    """Weighted labels given the mean weight of the step's whole batch (``Weighted``).

    ``total(values)`` sums a list of scalars over a strategy's replicas (as given
    outside one); called before the batch is cut into towers or slices.
    """
    if not isinstance(labels, Weighted):
        return labels

    def mean(weights):
        weights = tf.cast(weights, tf.float32)
        weight, count = total([tf.reduce_sum(weights), tf.cast(tf.size(weights), tf.float32)])
        return tf.math.divide_no_nan(weight, count)

    return labels._replace(mean_weight=tf.nest.map_structure(mean, labels.sample_weight))


def loss_name(group: str) -> str:
    """The scalar a group's loss is reported as: ``'generator_loss'``."""
    return f"{group}_loss"


@tf.autograph.experimental.do_not_convert
def total_loss(loss) -> tf.Tensor:
    """The loss reported as ``loss`` (float32): the one loss, or the groups' sum."""
    if isinstance(loss, Mapping):
        return tf.add_n([tf.cast(v, tf.float32) for v in loss.values()])
    return tf.cast(loss, tf.float32)


@tf.autograph.experimental.do_not_convert
def reported_scalars(spec: Spec, loss) -> dict[str, tf.Tensor]:
    """The Spec's scalars (and each group's loss) as float32, averaged as the loss is."""
    scalars = {name: tf.cast(value, tf.float32) for name, value in spec.scalars.items()}
    if isinstance(loss, Mapping):
        scalars.update({loss_name(group): tf.cast(v, tf.float32) for group, v in loss.items()})
    return scalars


@tf.autograph.experimental.do_not_convert
def global_examples(batch: tf.Tensor, placement, towers, share=None) -> Callable[[], tf.Tensor]:
    """The examples of the step's global batch, computed only if a summed loss asks.

    Towers see the whole batch; a strategy's replica its ``share`` of it (found by an
    all-reduce, ``placement.replica_share``, when not given).
    """
    if towers is not None:
        return lambda: batch

    def examples() -> tf.Tensor:
        found = share if share is not None else placement.replica_share(batch)[0]
        return batch / tf.cast(found, tf.float64)

    return examples
