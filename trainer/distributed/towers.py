"""Towers: one batch split over this process's devices (Effective TensorFlow's make_parallel).

Each batch is split along its first dimension into one shard per device, the model runs
forward *and* backward on each device (the gradient is taken inside the tower's
``tf.device`` scope, the TF2 form of ``colocate_gradients_with_ops=True``), and the
gradients are averaged with weights proportional to the shard sizes, so the update
equals the single-device one. Variables are shared by construction: every tower calls
the same Keras layers. For scale-out the Estimator uses tf.distribute instead
(``strategies.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from trainer import batch_statistics


def shard_sizes(batch_size: tf.Tensor, num_shards: int) -> tf.Tensor:
    """Sizes of ``num_shards`` near-equal shards of a batch: they differ by at most one."""
    batch_size = tf.cast(batch_size, tf.int32)
    base, extra = batch_size // num_shards, batch_size % num_shards
    return base + tf.cast(tf.range(num_shards) < extra, tf.int32)


def split(structure, num_shards: int) -> tuple[list, tf.Tensor]:
    """Splits every tensor of a nested structure along its first dimension.

    Returns:
      ``num_shards`` structures like ``structure``, and the shard sizes (int32 [n]).
      A batch that does not divide evenly gives shards one example apart; a batch
      smaller than ``num_shards`` gives some empty shards. A scalar (a batch-wide
      value such as ``Weighted.mean_weight``) is given to every shard as it is.
    """
    flat = tf.nest.flatten(structure)  # None (no labels) is a leaf, and stays None
    first = next(t for t in flat if t is not None and t.shape.rank)
    sizes = shard_sizes(tf.shape(first)[0], num_shards)
    pieces = [
        [t] * num_shards  # None (no labels), or a scalar every shard takes as it is
        if t is None or t.shape.rank == 0
        else tf.split(t, sizes, num=num_shards)
        for t in flat
    ]
    shards = [
        tf.nest.pack_sequence_as(structure, [p[i] for p in pieces]) for i in range(num_shards)
    ]
    return shards, sizes


def make_parallel(fn: Callable, devices: Sequence[str], **kwargs):
    """Runs ``fn(**shard)`` on each device on its shard of ``kwargs``; concatenates outputs.

    Every keyword argument (a tensor or nested structure of tensors) is split along
    the batch; ``fn`` must return a tensor or a nested structure of tensors whose
    first dimension is the shard's batch. Variables ``fn`` uses are shared.
    """
    shards, _ = split(kwargs, len(devices))
    outputs = []
    for i, (device, shard) in enumerate(zip(devices, shards, strict=True)):
        with tf.device(device), tf.name_scope(f"tower_{i}"):
            outputs.append(fn(**shard))
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)


class Towers:
    """One batch's forward and backward passes spread over ``devices``.

    Args:
      devices: one tower per device.
      state: the non-trainable state a training pass updates
        (``batch_statistics.Parts``): each tower starts from the same values and
        the towers leave what one pass over the whole batch would, so batch-norm
        statistics cover the whole batch rather than one tower's shard.
    """

    def __init__(self, devices: Sequence[str], state: batch_statistics.Parts | None = None):
        self.devices = list(devices)
        self.state = state if state is not None else batch_statistics.Parts([])

    def run(self, fn: Callable, features, labels, *args, training: bool = True):
        """Runs ``fn(features, labels, *args) -> (loss, scalars, per_example, gradients)``.

        Each tower runs ``fn`` on its shard of the batch inside its device's scope, so
        the gradients ``fn`` takes are computed on the tower's own device (TF1's
        ``colocate_gradients_with_ops``). ``loss`` is a shard's mean loss (or a dict of
        them); ``gradients`` its gradients (nested, None entries allowed) or None.
        Returns the batch's ``(loss, scalars, per_example, gradients)``: loss, scalars
        and gradients averaged weighted by shard size (an empty shard counts zero, not
        NaN), per-example values concatenated in batch order. ``training=False``
        (evaluation) leaves ``state`` alone.
        """
        shards, sizes = split((features, labels), len(self.devices))
        weights = tf.cast(sizes, tf.float32) / tf.cast(tf.reduce_sum(sizes), tf.float32)
        state = self.state if training else batch_statistics.Parts([])
        start, sums = state.start(), state.zeros()
        towers = []
        for i, (device, (shard_features, shard_labels)) in enumerate(
            zip(self.devices, shards, strict=True)
        ):
            with tf.device(device), tf.name_scope(f"tower_{i}"):
                loss, scalars, per_example, grads = fn(shard_features, shard_labels, *args)
                grads = tf.nest.map_structure(lambda g, i=i: _weighted(g, weights[i]), grads)
                sums = state.add(sums, start, weights[i])
            state.reset(start)  # the next tower starts from the same statistics
            towers.append((loss, scalars, per_example, grads))
        state.finish(sums, start)
        losses, scalars, per_example, grads = zip(*towers, strict=True)
        average = lambda *values: _weighted_sum(values, weights)  # noqa: E731
        return (
            tf.nest.map_structure(average, *losses),
            tf.nest.map_structure(average, *scalars),
            tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *per_example),
            tf.nest.map_structure(lambda *g: None if g[0] is None else tf.add_n(list(g)), *grads),
        )


def _weighted(value: tf.Tensor | None, weight: tf.Tensor) -> tf.Tensor | None:
    """``value * weight``, where a zero weight gives zero even for a NaN value."""
    if value is None:
        return None
    return tf.math.multiply_no_nan(value, tf.cast(weight, value.dtype))


def _weighted_sum(values: Sequence[tf.Tensor], weights: tf.Tensor) -> tf.Tensor:
    return tf.add_n([_weighted(v, weights[i]) for i, v in enumerate(values)])
