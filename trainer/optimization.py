"""The framework's side of optimisation: the learning-rate schedule, Momentum, and EMA.

Models say what to compute; how it is optimised (optimizer, schedule, clipping,
averaging) is chosen here and in gin, the same for every model.
"""

from __future__ import annotations

import contextlib
import math

import keras
import tensorflow as tf

from trainer.errors import UserError

DECAYS = ("constant", "step", "exponential", "cosine")


class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup, then a constant hold, then step, exponential or cosine decay.

    Args:
      learning_rate: the peak rate, reached at the end of warmup.
      warmup_steps: steps of linear increase from 0 (0: start at the peak).
      hold_steps: steps at the peak after warmup, before the decay starts.
      decay: 'constant' (no decay), 'step', 'exponential' or 'cosine'.
      decay_steps: for 'step' and 'exponential', steps per factor of ``decay_rate``;
        for 'cosine', the length of the cosine, after which the rate stays at
        ``final_learning_rate``.
      decay_rate: factor per ``decay_steps`` for 'step' and 'exponential'.
      final_learning_rate: where the cosine ends.
    """

    def __init__(
        self,
        learning_rate: float,
        warmup_steps: int = 0,
        hold_steps: int = 0,
        decay: str = "constant",
        decay_steps: int = 1000,
        decay_rate: float = 0.1,
        final_learning_rate: float = 0.0,
    ):
        if decay not in DECAYS:
            raise UserError(f"WarmupDecay.decay must be one of {', '.join(DECAYS)}, got {decay!r}")
        if decay != "constant" and decay_steps < 1:
            raise UserError(f"WarmupDecay.decay_steps must be >= 1, got {decay_steps}")
        self.learning_rate = learning_rate
        self.warmup_steps = warmup_steps
        self.hold_steps = hold_steps
        self.decay = decay
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.final_learning_rate = final_learning_rate

    def __call__(self, step):
        """The rate at optimizer iteration ``step`` (0 for the first update)."""
        step = tf.cast(step, tf.float32)
        peak = tf.constant(self.learning_rate, tf.float32)
        warmup = peak * step / max(self.warmup_steps, 1)
        after = tf.maximum(step - self.warmup_steps - self.hold_steps, 0.0)
        if self.decay == "step":
            decayed = peak * self.decay_rate ** tf.floor(after / self.decay_steps)
        elif self.decay == "exponential":
            decayed = peak * self.decay_rate ** (after / self.decay_steps)
        elif self.decay == "cosine":
            progress = tf.minimum(after / self.decay_steps, 1.0)
            final = self.final_learning_rate
            decayed = final + (peak - final) * 0.5 * (1.0 + tf.cos(math.pi * progress))
        else:
            decayed = peak
        return tf.where(step < self.warmup_steps, warmup, decayed)

    def get_config(self) -> dict:
        """The constructor's arguments (Keras serialisation)."""
        return dict(
            learning_rate=self.learning_rate,
            warmup_steps=self.warmup_steps,
            hold_steps=self.hold_steps,
            decay=self.decay,
            decay_steps=self.decay_steps,
            decay_rate=self.decay_rate,
            final_learning_rate=self.final_learning_rate,
        )


def momentum(
    learning_rate=0.01, momentum: float = 0.9, nesterov: bool = False, **kwargs
) -> keras.optimizers.SGD:
    """SGD with (Nesterov) momentum, the TF1 MomentumOptimizer, as its own gin name."""
    return keras.optimizers.SGD(learning_rate, momentum=momentum, nesterov=nesterov, **kwargs)


class WeightAverage:
    """An exponential moving average of variables, swapped in for eval and export.

    ``average = decay * average + (1 - decay) * value`` after every training step,
    starting from the initial values. The averages are checkpointed with the model.
    """

    def __init__(self, variables: list, decay: float):
        if not 0.0 < decay < 1.0:
            raise UserError(f"Estimator.ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.variables = variables
        with tf.init_scope():
            self.averages = [
                tf.Variable(v.value if hasattr(v, "value") else v, trainable=False, name=f"ema_{i}")
                for i, v in enumerate(variables)
            ]

    def update(self) -> None:
        """One averaging step (called inside the compiled train step)."""
        for average, v in zip(self.averages, self.variables, strict=True):
            average.assign(self.decay * average + (1.0 - self.decay) * tf.cast(v, average.dtype))

    @contextlib.contextmanager
    def swapped_in(self):
        """Holds the averages in the model's variables inside the block, then swaps back."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def _swap(self) -> None:
        for average, v in zip(self.averages, self.variables, strict=True):
            current = tf.identity(v.value if hasattr(v, "value") else v)
            v.assign(average)
            average.assign(current)
