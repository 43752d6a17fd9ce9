"""What a model's own training step (``ModelFn.train_step``) is handed, and checked by.

The step runs where every step runs, ``step.Steps._step``: a model's own step is one
way of taking a batch's gradients there (``Steps._own_part``) beside the declared loss.

For what the declarative form (one loss per group) cannot say: a gradient penalty
(gradients of gradients), gradients transformed before they are applied. The step
computes its gradients and hands each group's to ``optimizers[group].apply``; the
framework applies them once the step returns, as it applies its own: weighted by each
tower's or replica's share of the batch, summed over towers, all-reduced over
replicas and workers, clipped, each optimizer once per step. So a custom step gives
the same result on one device, on towers and under a strategy, and everything else
(metrics, summaries, checkpoints, exact resume, NaN handling) is the framework's as
for any model.

A step may apply each optimizer once (several updates of one group per batch would
need each tower's gradients before the step goes on); groups that take turns
(``Group(steps=k)``) give k updates of a group over k batches. It must not create
variables after its first call, nor keep Python state between calls: it is traced
once and then runs compiled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import tensorflow as tf

from trainer.errors import UserError
from trainer.model_fn import Mode, ModelFn, check_spec

MODEL = "model"  # the group name a model without optimizer_groups is given


def has_own_step(model_fn) -> bool:
    """Whether the model overrides ``ModelFn.train_step``."""
    return type(model_fn).train_step is not ModelFn.train_step


class GroupOptimizer:
    """What ``train_step`` is given for each group: its optimizer, applied later.

    Args:
      name: the group's name.
      variables: the group's trainable variables (the default of ``apply``).
      weight: this tower's or replica's share of the step's batch: the gradients
        of its mean loss are weighted by it, so that their sum is the whole batch's.
    """

    def __init__(self, name: str, variables: Sequence, weight: tf.Tensor):
        self.name, self.variables, self.weight = name, list(variables), weight
        self.given: dict[int, tf.Tensor] | None = None  # gradient by variable id

    def apply(self, gradients: Sequence, variables: Sequence | None = None) -> None:
        """Hands the group's gradients to the framework, which applies them after the step.

        Args:
          gradients: one per variable (None for a variable the loss does not reach),
            of this call's mean loss.
          variables: the group's variables they are for; all of them by default.
        """
        variables = self.variables if variables is None else list(variables)
        gradients = list(gradients)
        if self.given is not None:
            raise UserError(
                f"train_step applies optimizers[{self.name!r}] twice in one step: apply each "
                "group once (several updates per batch cannot wait for every tower's "
                "gradients); for k updates of a group over k batches, give the groups "
                "Group(steps=k)"
            )
        if len(gradients) != len(variables):
            raise UserError(
                f"train_step gives optimizers[{self.name!r}] {len(gradients)} gradients for "
                f"{len(variables)} variables: give one per variable"
            )
        own = {id(v) for v in self.variables}
        stray = [v.path for v in variables if id(v) not in own]
        if stray:
            raise UserError(
                f"train_step gives optimizers[{self.name!r}] a gradient for {stray[0]}, which "
                f"is not in group {self.name!r}: apply it with its own group's optimizer"
            )
        self.given = {
            id(v): tf.math.multiply_no_nan(g, tf.cast(self.weight, g.dtype))
            for g, v in zip(gradients, variables, strict=True)
            if g is not None
        }

    def apply_gradients(self, grads_and_vars) -> None:
        """Keras's form: ``apply_gradients(zip(gradients, variables))``."""
        pairs = list(grads_and_vars)
        self.apply([g for g, _ in pairs], [v for _, v in pairs])


class Tracing:
    """An optimizer for ``train_step`` traced to find what it reports: applies nothing."""

    def apply(self, gradients, variables=None) -> None:
        """Takes the gradients and drops them."""
        del gradients, variables

    def apply_gradients(self, grads_and_vars) -> None:
        """Takes the gradients and drops them."""
        del grads_and_vars


def active_groups(plan, phase: Sequence[int]) -> dict[str, list]:
    """The groups with a unit in ``phase``, each with all its variables."""
    groups: dict[str, list] = {}
    active = {plan.units[i].group for i in phase}
    for unit in plan.units:
        if unit.group in active:
            groups.setdefault(unit.group or MODEL, []).extend(unit.variables)
    return groups


def check(spec, name: str, groups: Sequence, optimizers: Mapping) -> None:
    """Refuses a Spec a model's ``train_step`` must not return, or an optimizer it left unused.

    ``name`` is the model's class name, ``groups`` its optimizer groups' names.
    """
    try:
        check_spec(spec, Mode.TRAIN, f"{name}.train_step", [g for g in groups if g is not None])
    except ValueError as error:
        raise UserError(str(error)) from None
    unused = [group for group, optimizer in optimizers.items() if optimizer.given is None]
    if unused:
        raise UserError(
            f"{name}.train_step applied no gradients with optimizers[{unused[0]!r}] (its turn "
            f"in this step): call optimizers[{unused[0]!r}].apply(gradients) once per step"
        )


def arranged(given: list[dict[str, GroupOptimizer]], wanted):
    """Each tower's (or the one) gradients summed, arranged as ``wanted`` lists variables."""
    summed: dict[int, tf.Tensor] = {}
    for optimizers in given:
        for optimizer in optimizers.values():
            for key, gradient in optimizer.given.items():
                summed[key] = gradient if key not in summed else summed[key] + gradient
    if isinstance(wanted, Mapping):
        return {g: [summed.get(id(v)) for v in variables] for g, variables in wanted.items()}
    return [summed.get(id(v)) for v in wanted]
