"""What a step does to gradients between taking them and applying them: pure functions.

Their global norm (a sparse gradient's rows of one id summed first), clipping to it,
and the mixed-float16 bookkeeping of one loss followed by several loss-scaled
optimizers (``one_scale_per_loss``): tensors and optimizers in, tensors out. The step
that calls them is ``step.Steps._apply``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from trainer.optimizer_groups import Plan


@tf.autograph.experimental.do_not_convert
def one_scale_per_loss(plan: Plan, by_group: bool) -> dict:
    """The losses followed by several loss-scaled units (mixed_float16), with the units.

    Keras scales one loss by one scale: the loss is scaled by its first active unit's
    scale (``scale_loss``), so every unit of it must unscale by that same scale, skip
    together on an overflow, and grow together.
    """
    by_loss: dict = {}
    for unit in plan.units:
        if isinstance(unit.optimizer, keras.optimizers.LossScaleOptimizer):
            by_loss.setdefault(unit.group if by_group else None, []).append(unit)
    return {loss: units for loss, units in by_loss.items() if len(units) > 1}


@tf.autograph.experimental.do_not_convert
def poisoned_unless_finite(grads: list) -> list:
    """The gradients, all made NaN if any is not finite.

    Each unit's loss-scale optimizer checks its own gradients: made to see what all
    of them are, the units skip a step (and halve their scale) together.
    """
    present = [g for g in grads if g is not None]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g))) for g in present])
    poison = tf.where(finite, 1.0, float("nan"))
    return [None if g is None else scaled(g, poison) for g in grads]


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def scaled(gradient, factor):
    """``gradient * factor``; an embedding's sparse gradient stays sparse, its rows scaled."""
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


@tf.autograph.experimental.do_not_convert
def share_scale(owner, units: list) -> None:
    """Every unit's loss scale and growth count set to ``owner``'s, frozen units too."""
    for unit in units:
        if unit.optimizer is not owner:
            unit.optimizer.dynamic_scale.assign(owner.dynamic_scale)
            unit.optimizer.step_counter.assign(owner.step_counter)


@tf.autograph.experimental.do_not_convert
def global_norm(grads: list) -> tf.Tensor:
    """The global norm of the gradients as the dense tensors they stand for.

    A sparse gradient (an embedding's ``IndexedSlices``) holds one row per lookup: an id
    looked up twice in a batch is two rows, whose norm is not the norm of their sum
    (``tf.linalg.global_norm`` takes the rows as they are). Rows of one id are summed
    first, as the dense gradient (and micro-batches' summed gradients) would be.
    """
    return tf.linalg.global_norm([_deduplicated(g) for g in grads if g is not None])


def _deduplicated(gradient):
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    ids, positions = tf.unique(gradient.indices)
    rows = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(ids)[0])
    return tf.IndexedSlices(rows, ids, gradient.dense_shape)


@tf.autograph.experimental.do_not_convert
def root_sum_square(norms: list[tf.Tensor]) -> tf.Tensor:
    """The norm of several norms' vectors taken together: ``sqrt(sum(n ** 2))``."""
    if len(norms) == 1:
        return norms[0]
    return tf.sqrt(tf.add_n([n**2 for n in norms]))


@tf.autograph.experimental.do_not_convert
def clipped(grads: list, clip_norm: float, scale: tf.Tensor) -> tuple[list, tf.Tensor]:
    """The gradients clipped to ``clip_norm`` (None entries stay None), and their norm.

    ``scale`` is the loss scale they carry (mixed float16; else 1): the norm is
    compared and returned unscaled.
    """
    norm = global_norm(grads)
    result, _ = tf.clip_by_global_norm(grads, clip_norm * scale, use_norm=norm)
    return result, norm / scale


@tf.autograph.experimental.do_not_convert
def scale_of(optimizer: keras.optimizers.Optimizer) -> tf.Tensor:
    """The loss scale of ``optimizer`` (mixed float16; else 1)."""
    return optimizer.scale_loss(tf.constant(1.0))


@tf.autograph.experimental.do_not_convert
def finite(objective) -> tf.Tensor:
    """Whether every loss of a step's objective is finite."""
    return tf.reduce_all(tf.stack([tf.math.is_finite(o) for o in tf.nest.flatten(objective)]))


@tf.autograph.experimental.do_not_convert
def tape_gradients(tape: tf.GradientTape, loss, variables):
    """Gradients of ``loss`` for ``variables``; of each loss of a dict for a dict of lists."""
    if isinstance(variables, dict):
        return {group: tape.gradient(loss[group], v) for group, v in variables.items()}
    return tape.gradient(loss, variables)
