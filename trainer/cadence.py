"""Actions between compiled blocks, and the one helper that decides their cadence.

The training loop runs compiled blocks of steps. Before each block it asks
``steps_until_due`` how far it may go so that every periodic action (logging,
checkpointing, evaluation) fires exactly at the steps it asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from absl import logging


@dataclasses.dataclass
class Periodic:
    """Calls ``fn(step)`` every ``every_steps`` steps; never when it is None or 0."""

    every_steps: int | None
    fn: Callable[[int], Any]

    def is_due(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``every_steps``."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def steps_to_next(self, step: int) -> int | None:
        """Steps from ``step`` to the next time this is due (None: never)."""
        return self.every_steps - step % self.every_steps if self.every_steps else None


@dataclasses.dataclass
class At:
    """Calls ``fn(step)`` once at each of the given steps."""

    steps: tuple[int, ...]
    fn: Callable[[int], Any]

    def is_due(self, step: int) -> bool:
        """True when ``step`` is one of ``steps``."""
        return step in self.steps

    def steps_to_next(self, step: int) -> int | None:
        """Steps from ``step`` to the next of ``steps`` (None: all passed)."""
        later = [s - step for s in self.steps if s > step]
        return min(later) if later else None


@dataclasses.dataclass
class Always:
    """Calls ``fn(step)`` after every block, without cutting blocks short."""

    fn: Callable[[int], Any]

    def is_due(self, step: int) -> bool:
        """True: every block's end."""
        del step
        return True

    def steps_to_next(self, step: int) -> None:
        """None: it asks for no block to end early."""
        del step


def steps_until_due(step: int, actions: Iterable[Periodic | At], limit: int) -> int:
    """How many steps to run from ``step`` before the next action is due (at most ``limit``)."""
    steps = [limit] + [n for a in actions if (n := a.steps_to_next(step)) is not None]
    return max(min(steps), 1)


class StopTraining(Exception):
    """Raised by an action to end training early (with a final checkpoint)."""


def run_due(actions: Iterable[Periodic | At], step: int) -> bool:
    """Runs the actions due at ``step``, in order; True if one stopped training."""
    try:
        for action in actions:
            if action.is_due(step):
                action.fn(step)
    except StopTraining as stop:
        logging.info("%s", stop)
        return True
    return False


class Patience:
    """Says when a metric has not improved for ``patience`` evaluations in a row."""

    def __init__(self, metric: str, patience: int, higher_is_better: bool = True):
        self.metric, self.patience, self.higher_is_better = metric, patience, higher_is_better
        self.best: float | None = None
        self.best_step: int | None = None
        self.waited = 0

    def should_stop(self, metrics: dict, step: int | None = None) -> bool:
        """Records the evaluation at ``step``; True once ``patience`` passed without a best."""
        value = metrics[self.metric]
        better = self.best is None or (
            value > self.best if self.higher_is_better else value < self.best
        )
        if better:
            self.best, self.best_step, self.waited = value, step, 0
        else:
            self.waited += 1
        return self.waited >= self.patience
