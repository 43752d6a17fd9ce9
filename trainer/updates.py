"""Applying one step's gradients: per loss clipped, per unit applied.

The step takes gradients of each loss (one, or one per group when ``Spec.loss`` is a
dict) with respect to the variables of the units active in its phase
(``groups.Plan``). ``Updates.apply`` then clips each loss's gradients to their global
norm (the summed gradient's, under every distribution), splits them by unit and runs
each unit's optimizer on its own: fused kernels in one process, Keras's
``apply_gradients`` under a strategy (one all-reduce per unit, or none when clipping
summed them already).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from trainer.distribution import Placement
from trainer.groups import Plan, Unit


class Updates:
    """The optimizers' steps of one model.

    Args:
      plan: the units and phases.
      placement: where the step runs.
      clip_gradient_norm: clip each loss's gradients to this global norm, or None.
      by_group: whether the model gives one loss per group (``Spec.loss`` a dict).
      gradient_norm: a variable the global norm of the applied gradients is written
        to (at the block's last step, or every step when clipping measures it).
    """

    def __init__(
        self,
        plan: Plan,
        placement: Placement,
        clip_gradient_norm: float | None,
        by_group: bool,
        gradient_norm: tf.Variable,
    ):
        self.plan, self.placement, self.by_group = plan, placement, by_group
        self.clip_gradient_norm, self.gradient_norm = clip_gradient_norm, gradient_norm
        summed = bool(clip_gradient_norm)
        self.apply_fns = [placement.update_fn(u.optimizer, summed=summed) for u in plan.units]

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

    def apply(self, gradients, phase: Sequence[int], last_of_block) -> None:
        """Clips each loss's gradients, then applies every active unit's share."""
        by_loss = gradients if self.by_group else {None: gradients}
        norms = []
        for group, grads in by_loss.items():
            units = [i for i in phase if not self.by_group or self.plan.units[i].group == group]
            if self.clip_gradient_norm:
                grads, norm = self._clipped(grads, self._scale(self.plan.units[units[0]]))
                norms.append(norm)
            offset = 0
            for i in units:
                count = len(self.plan.units[i].variables)
                self._apply_unit(i, grads[offset : offset + count])
                offset += count
        if not self.placement.measures_gradient_norm:  # a replica cannot assign it
            return
        if self.clip_gradient_norm:
            self.gradient_norm.assign(_root_sum_square(norms))
        elif last_of_block:
            self.gradient_norm.assign(self._norm(by_loss, phase))

    def _norm(self, by_loss: dict, phase: Sequence[int]) -> tf.Tensor:
        """The global norm of every loss's gradients, each unscaled by its loss scale."""
        norms = [
            tf.linalg.global_norm(grads) / self._scale(self._first(phase, group))
            for group, grads in by_loss.items()
        ]
        return _root_sum_square(norms)

    @staticmethod
    def _scale(unit: Unit) -> tf.Tensor:
        """The loss scale of ``unit``'s optimizer (mixed float16; else 1)."""
        return unit.optimizer.scale_loss(tf.constant(1.0))

    def _clipped(self, grads: list, scale: tf.Tensor) -> tuple[list, tf.Tensor]:
        """The gradients clipped to the global norm (of their sum over replicas)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        summed = self.placement.sum_gradients([grads[i] for i in present])
        norm = tf.linalg.global_norm(summed)
        clipped, _ = tf.clip_by_global_norm(summed, self.clip_gradient_norm * scale, use_norm=norm)
        grads = list(grads)
        for i, g in zip(present, clipped, strict=True):
            grads[i] = g
        return grads, norm / scale

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


def _root_sum_square(norms: list[tf.Tensor]) -> tf.Tensor:
    if len(norms) == 1:
        return norms[0]
    return tf.sqrt(tf.add_n([n**2 for n in norms]))
