"""A training run held to a share of the CPU, for tests that wait on a run (a signal, a
time limit, a lost worker) rather than on what it computes.

Such a run would otherwise race through steps no one looks at, and take the CPU from
the suite's other tests while the test waits. Bound on the command line (``FLAGS``)::

    --gin_param "import tests.support.pacing"
    --gin_param "experiment.callbacks = [@Paced()]"

after each block of steps it sleeps so that training takes ``share`` of the time.
What the run trains, reads and saves is unchanged: only how long it takes.
"""

from __future__ import annotations

import time

import gin
import keras

BINDINGS = ("import tests.support.pacing", "experiment.callbacks = [@Paced()]")
FLAGS = tuple(arg for binding in BINDINGS for arg in ("--gin_param", binding))


@gin.configurable
class Paced(keras.callbacks.Callback):
    """Sleeps after each block of steps, so that its steps take ``share`` of the time.

    The first block (which traces the step) and any block longer than ``longest``
    seconds count as ``longest``: the run stays paced, not stalled.
    """

    def __init__(self, share: float = 0.1, longest: float = 0.2):
        super().__init__()
        self.share, self.longest, self._began = share, longest, None

    def on_train_batch_begin(self, batch, logs=None):
        self._began = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        took = min(time.monotonic() - self._began, self.longest)
        time.sleep(took * (1 / self.share - 1))
