"""Rules on variables, chosen by regular expressions on their Keras paths.

``Optimization``'s ``learning_rate_multipliers``, ``frozen_until_step`` and
``no_weight_decay``: which variables each rule matches, the rate a multiplier gives
(``ScaledRate``, a schedule followed at the group's step), and the checks that
refuse a rule that cannot apply. ``optimizer_groups.plan`` splits each optimizer group by the
rules its variables match.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

import keras
import tensorflow as tf
from absl import logging

from trainer.errors import UserError
from trainer.settings import Optimization


def rule_of(v, rules: Optimization) -> tuple[float, int, tuple[str, ...]]:
    """``(multiplier, frozen until, patterns)`` of the first matching rules."""
    multiplier, frozen, patterns = 1.0, 0, []
    for pattern, factor in rules.learning_rate_multipliers.items():
        if re.search(pattern, v.path):
            multiplier, patterns = float(factor), [pattern]
            break
    for pattern, step in rules.frozen_until_step.items():
        if re.search(pattern, v.path):
            frozen = int(step)
            patterns += [pattern] if pattern not in patterns else []
            break
    return multiplier, frozen, tuple(patterns)


def rate_of(optimizer):
    """The optimizer's learning rate as given: a number or a schedule."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise UserError(
            "learning_rate_multipliers and frozen_until_step cannot split a loss-scaled "
            "optimizer (mixed_float16): use mixed_bfloat16, which needs no loss scaling, "
            "or float32"
        )
    rate = optimizer.get_config()["learning_rate"]
    return keras.optimizers.schedules.deserialize(rate) if isinstance(rate, dict) else rate


def with_rate(optimizer, rate, name: str):
    """A copy of ``optimizer`` (fresh state) whose learning rate is ``rate``.

    The rate follows the schedule at the group's step (``ScaledRate.clock``), not at
    the copy's own iteration count, which stays behind while the unit is frozen.
    """
    config = optimizer.get_config()
    config["learning_rate"] = rate
    config["name"] = re.sub(r"\W", "_", name)
    return type(optimizer).from_config(config)


class ScaledRate(keras.optimizers.schedules.LearningRateSchedule):
    """``multiplier`` times a rate (a number or a schedule) at the step a clock gives.

    ``clock`` is set when the steps are built (the group's step, from the global
    step); until then the optimizer's own iteration count is used.
    """

    def __init__(self, rate, multiplier: float):
        self.rate, self.multiplier = rate, multiplier
        self.clock = None

    def __call__(self, step):
        """The scaled rate at the clock's step."""
        if self.clock is not None:
            step = self.clock()
        base = self.rate(step) if callable(self.rate) else self.rate
        return tf.cast(base, tf.float32) * self.multiplier

    def get_config(self) -> dict:
        """Keras serialisation: the rate and the factor."""
        return {"rate": self.rate, "multiplier": self.multiplier}


def exclude_from_decay(name: str, optimizer, variables: list, patterns: Sequence[str]) -> None:
    """Tells the optimizer (AdamW's kind) to leave the variables ``patterns`` match undecayed."""
    if not patterns:
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not getattr(inner, "weight_decay", None):
        raise UserError(
            f"Optimization.no_weight_decay is set but the optimizer of {name!r} "
            f"({type(inner).__name__}) has no weight_decay: use AdamW(weight_decay=...), or "
            "leave no_weight_decay unset (an L2 regularizer is part of the loss)"
        )
    excluded = [v for v in variables if any(re.search(p, v.path) for p in patterns)]
    if excluded:
        inner.exclude_from_weight_decay(var_list=excluded)


def check_patterns(rules: Optimization, variables: list) -> None:
    """Refuses a rule that matches no variable; logs how many each matched."""
    for setting, patterns in (
        ("learning_rate_multipliers", rules.learning_rate_multipliers),
        ("frozen_until_step", rules.frozen_until_step),
        ("no_weight_decay", rules.no_weight_decay),
    ):
        for pattern in patterns:
            try:
                count = sum(bool(re.search(pattern, v.path)) for v in variables)
            except re.error as error:
                raise UserError(
                    f"Optimization.{setting} pattern {pattern!r} is not a regular expression: "
                    f"{error}"
                ) from None
            if not count:
                raise UserError(matches_nothing(f"Optimization.{setting}", pattern, variables))
            logging.info("Estimator.%s %r matches %d variables", setting, pattern, count)


def matches_nothing(where: str, pattern: str, variables: list) -> str:
    """Says that ``pattern`` matches no variable, naming the closest paths."""
    paths = [v.path for v in variables]
    close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.3) or paths[:3]
    return (
        f"{where} pattern {pattern!r} matches none of the model's {len(paths)} trainable "
        f"variables; their paths are like {', '.join(close)} (matched with re.search)"
    )
