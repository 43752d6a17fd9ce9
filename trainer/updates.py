"""Applying one step's gradients: per loss clipped, per unit applied.

The step takes gradients of each loss (one, or one per group when ``Spec.loss`` is a
dict) with respect to the variables of the units active in its phase
(``groups.Plan``). ``Updates.apply`` then sums each loss's gradients over a strategy's
replicas (one all-reduce), clips them to their global norm, splits them by unit and
runs each unit's optimizer on its own: fused kernels in one process, Keras's
``apply_gradients`` under a strategy (told not to sum them again). Every replica then
holds the summed gradient, so the gradient norm is known under every distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from trainer.distribution import Placement
from trainer.errors import UserError
from trainer.groups import Plan, Unit


class Updates:
    """The optimizers' steps of one model.

    Args:
      plan: the units and phases.
      placement: where the step runs.
      clip_gradient_norm: clip each loss's gradients to this global norm, or None.
      by_group: whether the model gives one loss per group (``Spec.loss`` a dict).
    """

    def __init__(
        self,
        plan: Plan,
        placement: Placement,
        clip_gradient_norm: float | None,
        by_group: bool,
    ):
        self.plan, self.placement, self.by_group = plan, placement, by_group
        self.clip_gradient_norm = clip_gradient_norm
        self.apply_fns = [placement.update_fn(u.optimizer) for u in plan.units]
        self.one_scale = _one_scale_per_loss(plan, by_group)
        if self.one_scale and placement.strategy is not None:
            names = ", ".join(u.name for units in self.one_scale.values() for u in units)
            raise UserError(
                f"mixed_float16 with one loss over several optimizers ({names}) keeps one loss "
                "scale for them in one process only: under a tf.distribute strategy use "
                "mixed_bfloat16 (no loss scale), or one optimizer without per-variable rules"
            )

    def wanted(self, phase: Sequence[int]):
        """The variables to take gradients of: a list, or per group a dict of lists."""
        if not self.by_group:
            return [v for i in phase for v in self.plan.units[i].variables]
        wanted: dict[str, list] = {}
        for i in phase:
            unit = self.plan.units[i]
            wanted.setdefault(unit.group, []).extend(unit.variables)
        return wanted

    def scale_loss(self, objective, phase: Sequence[int]):
        """Each loss scaled by its optimizer's loss scale (mixed float16; else as it is)."""
        if not self.by_group:
            return self._first(phase, None).optimizer.scale_loss(objective)
        return {
            group: self._first(phase, group).optimizer.scale_loss(loss)
            for group, loss in objective.items()
            if any(self.plan.units[i].group == group for i in phase)
        }

    def apply(self, gradients, phase: Sequence[int], last_of_block) -> tf.Tensor:
        """Sums and clips each loss's gradients, then applies every active unit's share.

        Returns the global norm of the gradients applied (of the summed gradient before
        clipping, unscaled): measured at every step when clipping needs it, else only
        at ``last_of_block`` (a pass over every gradient costs a small model ~15% under
        XLA), NaN at the other steps.
        """
        by_loss = gradients if self.by_group else {None: gradients}
        norms, summed = [], {}
        for group, grads in by_loss.items():
            units = [i for i in phase if not self.by_group or self.plan.units[i].group == group]
            grads = summed[group] = self._summed(grads)
            if self.clip_gradient_norm:
                grads, norm = self._clipped(grads, self._scale(self.plan.units[units[0]]))
                norms.append(norm)
            owner = self._first(phase, group).optimizer  # its scale scaled the loss
            if group in self.one_scale:  # one scale: unscaled by it, every unit skips or none
                _share_scale(owner, self.one_scale[group])
                grads = _poisoned_unless_finite(grads)
            offset = 0
            for i in units:
                count = len(self.plan.units[i].variables)
                self._apply_unit(i, grads[offset : offset + count])
                offset += count
            if group in self.one_scale:  # the frozen units too, for when they thaw
                _share_scale(owner, self.one_scale[group])
        if self.clip_gradient_norm:
            return _root_sum_square(norms)
        return tf.cond(
            tf.convert_to_tensor(last_of_block),
            lambda: self._norm(summed, phase),
            lambda: tf.constant(float("nan")),
        )

    def _norm(self, by_loss: dict, phase: Sequence[int]) -> tf.Tensor:
        """The global norm of every loss's gradients, each unscaled by its loss scale."""
        norms = [
            global_norm(grads) / self._scale(self._first(phase, group))
            for group, grads in by_loss.items()
        ]
        return _root_sum_square(norms)

    @staticmethod
    def _scale(unit: Unit) -> tf.Tensor:
        """The loss scale of ``unit``'s optimizer (mixed float16; else 1)."""
        return unit.optimizer.scale_loss(tf.constant(1.0))

    def _summed(self, grads: list) -> list:
        """Under a strategy, every replica's gradients summed (one all-reduce); else as given."""
        present = [i for i, g in enumerate(grads) if g is not None]
        grads = list(grads)
        summed = self.placement.sum_gradients([grads[i] for i in present])
        for i, g in zip(present, summed, strict=True):
            grads[i] = g
        return grads

    def _clipped(self, grads: list, scale: tf.Tensor) -> tuple[list, tf.Tensor]:
        """The gradients clipped to their global norm (None entries stay None), the norm."""
        norm = global_norm(grads)
        clipped, _ = tf.clip_by_global_norm(grads, self.clip_gradient_norm * scale, use_norm=norm)
        return clipped, norm / scale

    def _apply_unit(self, index: int, grads: list) -> None:
        unit = self.plan.units[index]
        pairs = [(g, v) for g, v in zip(grads, unit.variables, strict=True) if g is not None]
        if pairs:
            self.apply_fns[index]([g for g, _ in pairs], [v for _, v in pairs])

    def _first(self, phase: Sequence[int], group) -> Unit:
        """The first active unit following ``group``'s loss (any unit without groups)."""
        for i in phase:
            unit = self.plan.units[i]
            if not self.by_group or unit.group == group:
                return unit
        return self.plan.units[phase[0]]


def _one_scale_per_loss(plan: Plan, by_group: bool) -> dict:
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


def _poisoned_unless_finite(grads: list) -> list:
    """The gradients, all made NaN if any is not finite.

    Each unit's loss-scale optimizer checks its own gradients: made to see what all
    of them are, the units skip a step (and halve their scale) together.
    """
    present = [g for g in grads if g is not None]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(_values(g))) for g in present])
    poison = tf.where(finite, 1.0, float("nan"))
    return [None if g is None else _scaled(g, poison) for g in grads]


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _scaled(gradient, factor):
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def _share_scale(owner, units: list) -> None:
    """Every unit's loss scale and growth count set to ``owner``'s, frozen units too."""
    for unit in units:
        if unit.optimizer is not owner:
            unit.optimizer.dynamic_scale.assign(owner.dynamic_scale)
            unit.optimizer.step_counter.assign(owner.step_counter)


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


def _root_sum_square(norms: list[tf.Tensor]) -> tf.Tensor:
    if len(norms) == 1:
        return norms[0]
    return tf.sqrt(tf.add_n([n**2 for n in norms]))
