"""One long ``Estimator.train``, timed as a user runs it: a mark at each of its log steps.

``train`` calls a callback's ``on_epoch_end`` once per log period (its epochs), so the
marks fall between blocks of steps, never inside one; the first comes after the step
was traced. ``StopAfter`` stops the run once ``seconds`` have passed since it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import keras


class StopAfter(keras.callbacks.Callback):
    """``(step, time)`` at each log step; stops training ``seconds`` after the first.

    Args:
      seconds: how long to train past the first mark.
      step: the run's step now (``lambda: estimator.step``).
    """

    def __init__(self, seconds: float, step: Callable[[], int]):
        super().__init__()
        self.seconds, self.step = seconds, step
        self.marks: list[tuple[int, float]] = []

    def on_epoch_end(self, epoch, logs=None):
        self.marks.append((self.step(), time.perf_counter()))
        if self.marks[-1][1] - self.marks[0][1] >= self.seconds:
            self.model.stop_training = True
