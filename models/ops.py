"""The Effective TensorFlow cookbook, written to be numerically stable.

Every function that takes logits works in log space (``log_softmax``,
``reduce_logsumexp``), so logits like ``[1000., 0.]`` give exact, finite values and
gradients where the textbook formulas overflow to NaN. The cookbook's
``rnn_beam_search`` is ``beam_search`` (``models/decoding.py``): any step function,
in TF2 control flow.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from models.decoding import beam_search  # noqa: F401 - the cookbook's beam search, a stable op


def get_shape(tensor: tf.Tensor) -> list:
    """The shape as a list: Python ints where known statically, scalar tensors otherwise."""
    static = tensor.shape.as_list()
    dynamic = tf.unstack(tf.shape(tensor))
    return [s if s is not None else d for s, d in zip(static, dynamic, strict=True)]


def batch_gather(tensor: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
    """``tensor[b, indices[b]]`` for each ``b``: one row of ``[batch, n, ...]`` per example."""
    return tf.gather(tensor, indices, batch_dims=1)


def softmax_cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """``-sum(labels * log softmax(logits))`` over the last axis; labels may be soft."""
    return -tf.reduce_sum(labels * tf.nn.log_softmax(logits), axis=-1)


def softmax_entropy(logits: tf.Tensor) -> tf.Tensor:
    """The entropy of ``softmax(logits)`` over the last axis."""
    probabilities = tf.nn.softmax(logits)
    return tf.reduce_logsumexp(logits, axis=-1) - tf.reduce_sum(probabilities * logits, axis=-1)


def gaussian_kl(q: tuple, p: tuple = (0.0, 0.0)) -> tf.Tensor:
    """KL(q || p) of diagonal Gaussians given as ``(mean, log variance)``, summed on the last axis.

    The default ``p`` is the standard normal.
    """
    mean1, log_var1 = (tf.convert_to_tensor(t) for t in q)
    mean2, log_var2 = (tf.cast(t, mean1.dtype) for t in p)
    return tf.reduce_sum(
        0.5
        * (
            log_var2
            - log_var1
            + tf.exp(log_var1 - log_var2)
            + tf.square(mean1 - mean2) * tf.exp(-log_var2)
            - 1.0
        ),
        axis=-1,
    )


def leaky_relu(x: tf.Tensor, alpha: float = 0.2) -> tf.Tensor:
    """``x`` where positive, ``alpha * x`` elsewhere."""
    return tf.maximum(alpha * x, x)


def top_k_error(labels: tf.Tensor, logits: tf.Tensor, k: int = 5) -> tf.Tensor:
    """Per example: 1.0 when the label is not among the ``k`` largest logits, else 0.0."""
    hit = tf.math.in_top_k(tf.cast(labels, tf.int32), logits, k)
    return 1.0 - tf.cast(hit, tf.float32)


class Merge(keras.layers.Layer):
    """``dense(concat(a, b))`` where ``a`` and ``b`` may differ in rank and broadcast.

    Projecting each input separately and adding the results is the same affine map
    as projecting their concatenation, without materialising a broadcast copy: e.g.
    ``a`` of shape ``[batch, time, 3]`` merged with ``b`` of shape ``[batch, 1, 5]``.
    """

    def __init__(self, units: int, activation=None, name: str = "merge", **kwargs):
        super().__init__(name=name, **kwargs)
        self.project_a = keras.layers.Dense(units, use_bias=False, name=f"{name}_a")
        self.project_b = keras.layers.Dense(units, name=f"{name}_b")
        self.activation = keras.activations.get(activation)

    def call(self, a, b):
        """The merged projection of ``a`` and ``b``."""
        return self.activation(self.project_a(a) + self.project_b(b))
