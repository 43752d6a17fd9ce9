"""Which optimizer updates which variables, and at which steps.

A model trains with one optimizer over all its variables unless it says otherwise,
in two ways that combine:

* **Groups** (``ModelFn.optimizer_groups``): named sets of variables, each with its own
  optimizer and, when ``Spec.loss`` is a dict, its own loss: a GAN's generator and
  discriminator. Groups update together at every step, or take turns
  (``Group(steps=k)``: k steps of one group, then the next, as TF-GAN's
  ``GANTrainSteps``).
* **Rules** (``variable_rules.Rules``, ``Optimization``'s ``learning_rate_multipliers``,
  ``frozen_until_step`` and ``no_weight_decay``): variables chosen by a regular
  expression on their Keras path train at a multiple of their optimizer's rate, not at
  all before a step, or without decoupled weight decay.

Both are compiled into ``Unit``s: one optimizer over some variables, driven by one
group's loss, active from a step on and in its group's turns. A step applies the
units active at it (``Plan.phases``): each phase is its own branch of the compiled
step, chosen from the global step, so a unit's state (its moments, its iteration
count) changes only at the steps it is applied, and resuming is exact. One
optimizer and no rules is one unit and one phase: the step is what it always was.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainer import errors
from trainer import variable_rules as rules_
from trainer.errors import UserError
from trainer.settings import Optimization


@dataclasses.dataclass(frozen=True)
class Group:
    """Variables one optimizer updates, declared by ``ModelFn.optimizer_groups``.

    Attributes:
      variables: what the group holds: a Keras layer or model, a ``tf.Module``, a
        variable, a list of these, or a regular expression matched (``re.search``)
        against each trainable variable's Keras path (``'^generator/'``).
      steps: to take turns: the steps this group trains in a row before the next
        group (in the order ``optimizer_groups`` gives them) takes its turn. None,
        for every group, updates all of them at every step.
    """

    variables: Any
    steps: int | None = None


@dataclasses.dataclass
class Unit:
    """One optimizer over some variables, driven by one group's loss.

    Attributes:
      name: the unit's name in checkpoints and TensorBoard (the group's, or its
        group's with the rule's pattern).
      group: the group whose loss it follows; None when the model has one loss.
      optimizer: its own Keras optimizer (state, iteration count, schedule).
      variables: what it updates.
      frozen_until: the first global step it is applied at.
      rate: the scaled learning rate a multiplier rule gave it, or None.
    """

    name: str
    group: str | None
    optimizer: keras.optimizers.Optimizer
    variables: list
    frozen_until: int = 0
    rate: rules_.ScaledRate | None = None


class Plan:
    """The units of a model and the phases of its steps.

    Args:
      units: every unit, in a fixed order.
      turns: ``[(group, steps), ...]`` when the groups take turns, else empty.
    """

    def __init__(self, units: list[Unit], turns: Sequence[tuple[str, int]] = ()):
        self.units, self.turns = units, list(turns)
        self.cycle = sum(steps for _, steps in self.turns)
        found = {self.active(step) for step in self._telling_steps()}
        self.phases = sorted(found, key=lambda phase: (-len(phase), phase))

    @property
    def groups(self) -> list[str | None]:
        """The groups, each once, in the units' order."""
        return list(dict.fromkeys(u.group for u in self.units))

    @tf.autograph.experimental.do_not_convert
    def active(self, step: int) -> tuple[int, ...]:
        """The indices of the units applied at global step ``step`` (0 for the first)."""
        return tuple(i for i, unit in enumerate(self.units) if self._is_active(unit, step))

    @tf.autograph.experimental.do_not_convert
    def frozen(self, phase: tuple[int, ...]) -> set[int]:
        """The ids of the variables that wait for their ``frozen_until_step`` in ``phase``.

        Not those of a group whose turn it is not (a GAN's discriminator while the
        generator trains): only units left out at every step of the phase because
        their step has not come.
        """
        steps = [s for s in self._telling_steps() if self.active(s) == tuple(phase)]
        return {
            id(v)
            for i, unit in enumerate(self.units)
            if i not in phase and steps and all(s < unit.frozen_until for s in steps)
            for v in unit.variables
        }

    def phase_index(self, step: tf.Tensor) -> tf.Tensor:
        """The index in ``phases`` of the units active at ``step``, computed in the graph."""
        active = tf.stack([self._is_active(unit, step) for unit in self.units])
        masks = np.array([[i in phase for i in range(len(self.units))] for phase in self.phases])
        matches = tf.reduce_all(tf.equal(tf.constant(masks), active[tf.newaxis]), axis=1)
        return tf.cast(tf.argmax(tf.cast(matches, tf.int32)), tf.int32)

    def group_step(self, group: str | None, step: tf.Tensor) -> tf.Tensor:
        """How many of the global steps before ``step`` were ``group``'s turns."""
        if not self.turns:
            return step
        start, length = self._turn(group)
        done = (step // self.cycle) * length
        return done + tf.clip_by_value(step % self.cycle - start, 0, length)

    @tf.autograph.experimental.do_not_convert
    def _is_active(self, unit: Unit, step):
        """Whether ``unit`` is applied at ``step``: a number, or a tensor in the graph."""
        active = step >= unit.frozen_until
        if self.turns:
            start, length = self._turn(unit.group)
            position = step % self.cycle
            active = active & (position >= start) & (position < start + length)
        return active

    def _turn(self, group: str | None) -> tuple[int, int]:
        start = 0
        for name, steps in self.turns:
            if name == group:
                return start, steps
            start += steps
        raise KeyError(group)

    @tf.autograph.experimental.do_not_convert
    def _telling_steps(self) -> list[int]:
        """Steps at which every reachable set of active units is seen at least once."""
        starts = sorted({0, *(u.frozen_until for u in self.units)})
        return [s + k for s in starts for k in range(max(self.cycle, 1))]


def declared(model_fn) -> dict[str, Group] | None:
    """The model's ``optimizer_groups()``, checked; None when it declares none."""
    groups = model_fn.optimizer_groups()
    if groups is None:
        return None
    name = type(model_fn).__name__
    if not isinstance(groups, Mapping) or not groups:
        raise UserError(
            f"{name}.optimizer_groups() must return a dict of group name -> trainer.Group "
            f"(or None), got {type(groups).__name__}"
        )
    for key, group in groups.items():
        if not isinstance(group, Group):
            raise UserError(
                f"{name}.optimizer_groups()[{key!r}] is a {type(group).__name__}: wrap it as "
                f"trainer.Group({key!r} variables)"
            )
    steps = [group.steps for group in groups.values()]
    if any(s is not None for s in steps) and not all(isinstance(s, int) and s >= 1 for s in steps):
        raise UserError(
            f"{name}'s groups take turns only when each gives steps >= 1, got "
            + ", ".join(f"{k} {g.steps}" for k, g in groups.items())
        )
    return dict(groups)


def optimizers_for(
    groups: Sequence[str] | None, optimizer: Any
) -> dict[str | None, keras.optimizers.Optimizer]:
    """Each group's optimizer from the Estimator's ``optimizer``: one, or a dict by group.

    One optimizer given for several groups gives each group a copy of it, with state
    of its own. With no groups the model's one optimizer is keyed None.
    """
    if optimizer is None:
        optimizer = keras.optimizers.Adam()
    for key, given in optimizer.items() if isinstance(optimizer, Mapping) else [(None, optimizer)]:
        name = "optimizer" if key is None else f"optimizer[{key!r}]"
        errors.check_instance(name, given, keras.optimizers.Optimizer, "a Keras optimizer")
    if groups is None:
        if isinstance(optimizer, Mapping):
            raise UserError(
                f"Estimator.optimizer is a dict ({', '.join(map(repr, optimizer))}) but the "
                "model declares no optimizer_groups(): give one optimizer"
            )
        return {None: optimizer}
    if not isinstance(optimizer, Mapping):
        return {g: type(optimizer).from_config(optimizer.get_config()) for g in groups}
    missing, unknown = set(groups) - set(optimizer), set(optimizer) - set(groups)
    if missing or unknown:
        problem = (
            f"has no optimizer for group {sorted(missing)[0]!r}"
            if missing
            else f"names {sorted(unknown)[0]!r}, which is not a group"
        )
        raise UserError(
            f"Estimator.optimizer {problem}: the model's groups are "
            f"{', '.join(map(repr, groups))}; give one optimizer for each"
        )
    return {g: optimizer[g] for g in groups}


def plan(
    model_fn,
    groups: Mapping[str, Group] | None,
    optimizers: Mapping,
    rules: Optimization,
    global_step: tf.Variable,
) -> Plan:
    """The units of ``model_fn``'s variables: one per group, split further by the rules.

    A unit's scaled learning rate follows its group's step, counted from ``global_step``.
    A model of no trainable variable has one unit that updates none (a Keras model whose
    only state is what its call updates: its step runs, as ``fit``'s does).
    """
    variables = model_fn.trainable_variables
    if not variables and groups is None:
        return Plan([Unit("model", None, optimizers[None], [])])
    if groups is None:
        members = {None: variables}
    else:
        members = _members(type(model_fn).__name__, groups, variables)
    rules_.check_patterns(rules, variables)
    units = []
    for group, held in members.items():
        units += _units(group, held, optimizers[group], rules)
    names = [u.name for u in units]
    for i, unit in enumerate(units):  # two patterns read alike ('^body/', 'body'): apart
        if names.count(unit.name) > 1:
            unit.name = f"{unit.name}_{names[:i].count(unit.name) + 1}"
    for unit in units:
        rules_.exclude_from_decay(unit.name, unit.optimizer, unit.variables, rules.no_weight_decay)
    turns = []
    if groups is not None and any(g.steps for g in groups.values()):
        turns = [(name, g.steps) for name, g in groups.items()]
    made = Plan(units, turns)
    for unit in units:
        if unit.rate is not None:
            unit.rate.clock = functools.partial(made.group_step, unit.group, global_step)
    return made


def _units(group: str | None, held: list, optimizer, rules: Optimization) -> list[Unit]:
    """The group's variables split by the rules they match; one optimizer per split."""
    by_rule: dict[tuple, list] = {}
    for v in held:
        by_rule.setdefault(rules_.rule_of(v, rules), []).append(v)
    units = []
    for (multiplier, frozen, patterns), variables in by_rule.items():
        if not patterns:
            units.append(Unit(group or "model", group, optimizer, variables, frozen))
            continue
        readable = "+".join(re.sub(r"[^\w/.-]+", "", p).strip("/") or "rule" for p in patterns)
        name = readable if group is None else f"{group}:{readable}"
        rate = rules_.ScaledRate(rules_.rate_of(optimizer), multiplier)
        units.append(
            Unit(name, group, rules_.with_rate(optimizer, rate, name), variables, frozen, rate)
        )
    return units


def _members(name: str, groups: Mapping[str, Group], variables: list) -> dict[str, list]:
    """Each group's trainable variables; every variable in exactly one group."""
    owner: dict[int, str] = {}
    members = {}
    for group, declared_ in groups.items():
        held = _select(name, group, declared_.variables, variables)
        for v in held:
            if id(v) in owner:
                raise UserError(
                    f"{name}'s variable {v.path} is in group {owner[id(v)]!r} and in "
                    f"{group!r}: each variable has one optimizer; put it in one group"
                )
            owner[id(v)] = group
        members[group] = held
    loose = [v.path for v in variables if id(v) not in owner]
    if loose:
        raise UserError(
            f"{name}'s variables {', '.join(loose[:4])}{' ...' if len(loose) > 4 else ''} "
            "are in none of its optimizer_groups() and would never train: add them to a "
            "group, or make them non-trainable"
        )
    return members


def _select(name: str, group: str, spec, variables: list) -> list:
    """The trainable variables a Group's ``variables`` names, in the model's order."""
    if isinstance(spec, str):
        held = [v for v in variables if re.search(spec, v.path)]
        if not held:
            raise UserError(rules_.matches_nothing(f"{name}'s group {group!r}", spec, variables))
        return held
    wanted = {id(v) for v in _variables_of(spec)}
    held = [v for v in variables if id(v) in wanted]
    if not held:
        raise UserError(
            f"{name}'s group {group!r} holds no trainable variable of the model: give it the "
            "model's own layers (built in __init__) or a pattern on their paths"
        )
    return held


def _variables_of(spec) -> list:
    if isinstance(spec, keras.Variable | tf.Variable):
        return [spec]
    if isinstance(spec, keras.layers.Layer):
        return list(spec.trainable_variables)
    if isinstance(spec, tf.Module):  # a ModelFn's part
        return list(getattr(spec, "trainable_variables", []))
    if isinstance(spec, list | tuple):
        return [v for item in spec for v in _variables_of(item)]
    raise UserError(
        f"a trainer.Group holds layers, variables or a pattern, got {type(spec).__name__}"
    )
