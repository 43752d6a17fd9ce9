"""What the benchmarks train on: one batch held in memory, read at every step.

So the input side is not what they measure. The same batch every run: images drawn
uniformly, and class ids of 10 classes, from fixed seeds.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf


def batch(size: int, shape: Sequence[int] = (28, 28, 1)) -> tuple[tf.Tensor, tf.Tensor]:
    """``(images, labels)``: ``size`` images of ``shape`` and their class ids."""
    images = tf.random.stateless_uniform([size, *shape], seed=[1, 2])
    labels = tf.random.stateless_uniform([size], seed=[3, 4], maxval=10, dtype=tf.int64)
    return images, labels


def input_fn(images: tf.Tensor, labels: tf.Tensor):
    """An input_fn that yields ``({'image': images}, {'label': labels})`` at every step."""

    def repeated(mode, params):
        del mode, params
        return tf.data.Dataset.from_tensors(({"image": images}, {"label": labels})).repeat()

    return repeated
