"""State a training pass updates (batch-norm moving statistics) when a batch is cut in parts.

Towers split a batch into shards, micro-batches into slices; each part's forward pass
moves the layers' non-trainable float state (a ``BatchNormalization``'s moving mean
and variance) by its own examples. One device moves it once, by the whole batch.
``Parts`` makes the cut batch leave what the whole batch would: every part starts
from the state the step started with, and afterwards the state is

* for a moving mean (and any other float state): the parts' ends averaged,
  weighted by their share of the examples. A moving mean ends at
  ``momentum * start + (1 - momentum) * batch_mean``, which is linear in the
  batch's mean, and the batch's mean is the shares' weighted mean of the parts';
* for a moving variance: the same average plus what the parts' means spread
  around the whole batch's adds (the law of total variance: the batch's variance
  is the mean of the parts' variances plus the variance of their means), read
  back from the moving means: ``part_mean - batch_mean = (m_part - m) / (1 - momentum)``.

Keras's batch norm moves its statistics by the biased batch variance, which is what
the law adds up exactly. The normalisation itself uses each part's own statistics
(as Keras's does on each replica of a strategy), so a batch-norm model's gradients
depend on the cut; ``BatchNormalization(synchronized=True)`` normalises by the whole
batch across a strategy's replicas.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf

from trainer import layer_losses
from trainer.errors import UserError


@dataclasses.dataclass(frozen=True)
class Moments:
    """One batch-norm layer's moving mean and variance, and its momentum."""

    mean: tf.Variable
    variance: tf.Variable
    momentum: float


def moments_of(layers) -> list[Moments]:
    """The moving statistics of every batch-norm layer in ``layers`` (and inside them)."""
    return [
        Moments(layer.moving_mean, layer.moving_variance, float(layer.momentum))
        for layer in layer_losses.unique_layers(layers)
        if isinstance(layer, keras.layers.BatchNormalization)
        and layer.built
        and not layer.renorm  # renorm derives its variance from a moving stddev
    ]


def parts_of(model_fn) -> Parts:
    """The state a training pass of ``model_fn`` updates, as ``Parts``."""
    return Parts(model_fn.non_trainable_variables, moments_of(model_fn.layers))


class Parts:
    """The float state of a model over the parts of one batch, left as the whole batch's.

    Use: ``start = parts.start()``; for each part ``parts.reset(start)``, run it, then
    ``sums = parts.add(sums, start, share)`` (from ``parts.zeros()``); finally
    ``parts.finish(sums, start)``. The sums are tensors, so that a ``tf.while_loop``
    can carry them.

    Args:
      state: non-trainable variables; integer ones (dropout RNG seeds) are left to
        advance through the parts in turn.
      moments: the batch-norm statistics among them (``moments_of``).
    """

    def __init__(self, state, moments: list[Moments] = ()):
        self.state = [v for v in state if tf.as_dtype(v.dtype).is_floating]
        found = {id(v) for v in self.state}
        self.moments = [m for m in moments if id(m.mean) in found and id(m.variance) in found]
        self._means = [self._position(m.mean) for m in self.moments]
        self._variances = [self._position(m.variance) for m in self.moments]

    def _position(self, variable) -> int:
        return next(i for i, v in enumerate(self.state) if v is variable)

    def start(self) -> list[tf.Tensor]:
        """The state's values now, before any part."""
        return [tf.identity(v.value if hasattr(v, "value") else v) for v in self.state]

    def reset(self, start: list[tf.Tensor]) -> None:
        """Puts the state back where the step started, for the next part."""
        for v, value in zip(self.state, start, strict=True):
            v.assign(value)

    def zeros(self) -> list[tf.Tensor]:
        """Empty sums: each state's weighted ends, then each moving mean's squared moves."""
        shapes = [v.shape for v in self.state] + [m.mean.shape for m in self.moments]
        return [tf.zeros(shape, tf.float64) for shape in shapes]

    def add(self, sums: list, start: list, share: tf.Tensor) -> list[tf.Tensor]:
        """The sums with one part's ends added, weighted by its ``share`` of the examples.

        In float64: the spread of the parts' means is a small difference of large
        sums. A part without examples (share 0) adds nothing, even NaN statistics.
        """
        share = tf.cast(share, tf.float64)
        ends = [tf.cast(v.value if hasattr(v, "value") else v, tf.float64) for v in self.state]
        moves = [ends[i] - tf.cast(start[i], tf.float64) for i in self._means]
        added = ends + [move * move for move in moves]
        return [s + tf.math.multiply_no_nan(a, share) for s, a in zip(sums, added, strict=True)]

    def finish(self, sums: list, start: list) -> None:
        """Sets the state to what the whole batch leaves (the module's docstring)."""
        count = len(self.state)
        values = list(sums[:count])
        for k, (mean, variance) in enumerate(zip(self._means, self._variances, strict=True)):
            moved = values[mean] - tf.cast(start[mean], tf.float64)  # the parts' mean move
            spread = sums[count + k] - moved * moved  # the shares' variance of the moves
            rest = 1.0 - self.moments[k].momentum
            values[variance] += tf.maximum(spread, 0.0) / rest if rest > 0 else 0.0
        for v, value in zip(self.state, values, strict=True):
            v.assign(tf.cast(value, v.dtype))


def check_synchronized(layers, slicing: str | None, towers: bool) -> None:
    """Refuses ``BatchNormalization(synchronized=True)`` where parts cannot share statistics.

    Micro-batch slices run one after the other, and towers have no replica context;
    a strategy's replicas all-reduce them.
    """
    synchronized = [
        repr(layer.name)
        for layer in layer_losses.unique_layers(layers)
        if getattr(layer, "synchronized", False)
    ]
    if not synchronized or (slicing is None and not towers):
        return
    how = (
        f"{slicing} runs each slice alone; unset it"
        if slicing
        else "towers do not share them; use distribution = 'mirrored', whose replicas do"
    )
    raise UserError(
        f"BatchNormalization {', '.join(synchronized)} is synchronized=True, which "
        f"normalizes by the whole batch's statistics, but {how} (or make it "
        "synchronized=False: each part by its own)"
    )


@tf.autograph.experimental.do_not_convert
def frozen_norms(layers, frozen: set[int]) -> list[keras.layers.Layer]:
    """The batch-norm layers (in and inside ``layers``) whose weights are all ``frozen`` ids."""
    return [
        layer
        for layer in layer_losses.unique_layers(layers)
        if isinstance(layer, keras.layers.BatchNormalization)
        and layer.trainable_variables
        and all(id(v) in frozen for v in layer.trainable_variables)
    ]


@contextlib.contextmanager
def inference_mode(layers):
    """Batch-norm layers among ``layers`` normalise by, and keep, their moving statistics.

    As Keras runs a layer set ``trainable = False`` (its fine-tuning guide): while a
    phase of the step is traced in which their weights are frozen.
    """
    frozen = [layer for layer in layers if layer.trainable]
    for layer in frozen:
        layer.trainable = False
    try:
        yield
    finally:
        for layer in frozen:
            layer.trainable = True
