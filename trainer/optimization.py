"""The framework's side of optimisation: the learning-rate schedule, Momentum, and EMA.

Models say what to compute; how it is optimised (optimizer, schedule, clipping,
averaging) is chosen here and in gin, the same for every model.
"""

from __future__ import annotations

import contextlib
import math

import keras
import tensorflow as tf
from absl import logging

from trainer import errors, internals
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

    ``average = decay * average + (1 - decay) * value`` after every training step, and
    ``average = value`` after the first (global step 0), as Keras's ``use_ema``: the
    average starts from the weights training starts from, warm-started ones too, not
    from the values the variables were made with. The averages are checkpointed
    with the model.
    """

    def __init__(self, variables: list, decay: float):
        if not 0.0 < decay < 1.0:
            raise UserError(f"Optimization.ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.variables = variables
        with tf.init_scope():
            self.averages = [
                tf.Variable(v.value if hasattr(v, "value") else v, trainable=False, name=f"ema_{i}")
                for i, v in enumerate(variables)
            ]

    def update(self, first: tf.Tensor | bool = False) -> None:
        """One averaging step (inside the compiled train step); ``first``: the run's first."""
        decay = tf.where(first, 0.0, self.decay)
        for average, v in zip(self.averages, self.variables, strict=True):
            decay = tf.cast(decay, average.dtype)
            average.assign(decay * average + (1.0 - decay) * tf.cast(v, average.dtype))

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


def take_ema(optimizers: dict, ema_decay: float | None) -> tuple[dict, float | None]:
    """The optimizers without Keras's ``use_ema``, and the weight average's decay.

    An optimizer compiled with ``use_ema=True`` averages the weights the way
    ``Optimization.ema_decay`` does (from the first step, at ``ema_momentum``); ``fit`` then
    overwrites the weights with the average when it ends, so that Keras's evaluate,
    predict and save see it. Here the average becomes the run's ``WeightAverage``:
    evaluation, prediction and export use it, and training goes on from the trained
    weights (a resumed run continues as an unbroken one). The optimizers are copied
    with ``use_ema=False``, so the average is not kept twice.
    """
    averaging = {group: o for group, o in optimizers.items() if getattr(o, "use_ema", False)}
    if not averaging:
        return optimizers, ema_decay
    where = ", ".join("the optimizer" if g is None else f"group {g!r}" for g in averaging)
    momenta = {float(o.ema_momentum) for o in averaging.values()}
    if len(averaging) < len(optimizers) or len(momenta) > 1:
        raise UserError(
            f"use_ema is set on {where} but not on every group's optimizer with one "
            "ema_momentum: the framework keeps one average of all weights; set it on all "
            "alike, or use Optimization.ema_decay instead"
        )
    momentum = momenta.pop()
    if any(o.ema_overwrite_frequency for o in averaging.values()):
        raise UserError(
            f"ema_overwrite_frequency is set on {where}: the framework trains on the "
            "weights and evaluates and exports their average; leave it None"
        )
    if ema_decay is not None and ema_decay != momentum:
        raise UserError(
            f"Optimization.ema_decay is {ema_decay} but {where} has use_ema with "
            f"ema_momentum {momentum}: give one of them"
        )
    logging.info(
        "use_ema (ema_momentum %s) on %s is the run's weight average: evaluate, predict and "
        "export use it, and training goes on from the trained weights",
        momentum,
        where,
    )
    try:
        copies = {
            group: type(o).from_config({**o.get_config(), "use_ema": False})
            for group, o in optimizers.items()
        }
    except (TypeError, ValueError) as error:
        raise UserError(
            f"cannot copy {where} without use_ema from its get_config(): "
            f"{errors.first_line(error)}; use Optimization.ema_decay instead"
        ) from None
    return copies, momentum


# Keras options that TF's fused training kernels do not cover, at their "off" values.
_UNFUSED_OPTIONS = dict(
    weight_decay=None,
    clipnorm=None,
    clipvalue=None,
    global_clipnorm=None,
    use_ema=False,
    loss_scale_factor=None,
    gradient_accumulation_steps=None,
    amsgrad=False,
)


def fused_update(optimizer: keras.optimizers.Optimizer):
    """``update(gradients, variables)``: the optimizer's step in one kernel per variable.

    Keras 3 writes Adam as about fifteen elementwise ops per variable, each its own
    pass over the weights; TF's training kernels (``ResourceApplyAdam``,
    ``ResourceApplyKerasMomentum``, ``ResourceApplyGradientDescent``, the ones TF1's
    optimizers ran) do the same arithmetic in one pass, which trains the seed's MLP
    ~10-15% faster. Only plain ``Adam`` and ``SGD`` are fused; any option the kernels
    do not have (amsgrad, weight decay, clipping, EMA, accumulation, loss scaling)
    or another optimizer returns Keras's own ``apply_gradients``. The optimizer's
    variables, learning-rate schedule and iteration count are Keras's either way,
    so checkpoints do not depend on which one ran.
    """
    kernel, slots = _KERNELS.get(type(optimizer), (None, ()))
    plain = all(getattr(optimizer, k, off) == off for k, off in _UNFUSED_OPTIONS.items())
    # Keras's slot lists are private: should a release rename them, its own update runs.
    known = all(hasattr(optimizer, name) for name in ("_get_variable_index", *slots))
    if kernel is not None and plain and known:
        return lambda gradients, variables: _fused(optimizer, kernel, gradients, variables)
    return lambda gradients, variables: keras_update(optimizer, gradients, variables)


def keras_update(optimizer, gradients, variables) -> None:
    """Keras's own ``apply_gradients``, of dense gradients.

    An embedding's sparse gradient holds one row per lookup, and Keras 3 on TensorFlow
    squares each row before it adds the rows of one id up: an id looked up twice in a
    step adds ``g1^2 + g2^2`` to Adam's second moment, not ``(g1 + g2)^2``, so that the
    update would depend on how the step's lookups were split over devices and
    micro-batches. Every optimizer here takes the dense gradient instead, as Keras on
    JAX does (and tf.keras 2, which summed the rows of one id first); see
    docs/guide/keras.md.
    """
    say_dense_tables(optimizer, gradients, variables)
    dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients]
    optimizer.apply_gradients(zip(dense, variables, strict=True))


_SAID: set[str] = set()  # the tables whose dense update the log has named


def say_dense_tables(optimizer, gradients, variables) -> None:
    """Names, once, the tables whose update differs from ``fit``'s on TensorFlow by design.

    Under an update not linear in the gradient (Adam, RMSprop, Adagrad: not SGD), an
    embedding's sparse gradient taken dense gives another update than Keras 3 on
    TensorFlow, which updates each looked-up row apart (``keras_update``).
    """
    if isinstance(optimizer, keras.optimizers.SGD):
        return
    tables = [
        getattr(v, "path", v.name)
        for g, v in zip(gradients, variables, strict=True)
        if isinstance(g, tf.IndexedSlices) and getattr(v, "path", v.name) not in _SAID
    ]
    if not tables:
        return
    _SAID.update(tables)
    logging.info(
        "Embedding tables %s take %s's update of their dense gradient (the rows of one id "
        "summed first, as Keras on JAX and tf.keras 2 do); Keras 3's fit on TensorFlow "
        "updates each looked-up row apart, so its runs of this model differ from these by "
        "design (docs/guide/keras.md, 'Same numbers as Keras', note 7)",
        ", ".join(tables),
        type(optimizer).__name__,
    )


def _fused(optimizer, kernel, gradients, variables) -> None:
    """Runs ``kernel`` on each variable at the current learning rate; counts the step."""
    if any(getattr(v, "overwrite_with_gradient", False) for v in variables):  # float8 scales
        return keras_update(optimizer, gradients, variables)
    say_dense_tables(optimizer, gradients, variables)
    learning_rate = tf.convert_to_tensor(optimizer.learning_rate)  # the schedule's, now
    for gradient, variable in zip(gradients, variables, strict=True):
        slot = internals.slot_index(optimizer, variable)
        gradient = tf.cast(tf.convert_to_tensor(gradient), variable.dtype)  # dense: keras_update
        kernel(optimizer, slot, variable.handle, gradient, learning_rate)
    for variable in variables:  # after the update, as Keras's apply: a NonNeg kernel, say
        if getattr(variable, "constraint", None) is not None:
            variable.assign(variable.constraint(variable))
    optimizer.iterations.assign_add(1)


def _adam(optimizer, slot, handle, gradient, learning_rate) -> None:
    """Keras's Adam, one pass.

    m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2);
    w -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + epsilon), t = iterations + 1.
    """

    def cast(x):
        return tf.cast(x, gradient.dtype)

    step = cast(optimizer.iterations + 1)
    m, v = internals.adam_slots(optimizer, slot)
    tf.raw_ops.ResourceApplyAdam(
        var=handle,
        m=m.handle,
        v=v.handle,
        beta1_power=tf.pow(cast(optimizer.beta_1), step),
        beta2_power=tf.pow(cast(optimizer.beta_2), step),
        lr=cast(learning_rate),
        beta1=cast(optimizer.beta_1),
        beta2=cast(optimizer.beta_2),
        epsilon=cast(optimizer.epsilon),
        grad=gradient,
    )


def _sgd(optimizer, slot, handle, gradient, learning_rate) -> None:
    """Keras's SGD, one pass.

    w -= lr g; with momentum: m = momentum m - lr g, then w += m (Nesterov:
    w += momentum m - lr g).
    """
    learning_rate = tf.cast(learning_rate, gradient.dtype)
    if optimizer.momentum == 0:
        tf.raw_ops.ResourceApplyGradientDescent(var=handle, alpha=learning_rate, delta=gradient)
        return
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=handle,
        accum=optimizer.momentums[slot].handle,
        lr=learning_rate,
        grad=gradient,
        momentum=tf.cast(optimizer.momentum, gradient.dtype),
        use_nesterov=optimizer.nesterov,
    )


# The fused kernel of each optimizer class, and the slot lists it reads.
_KERNELS = {
    keras.optimizers.Adam: (_adam, ("_momentums", "_velocities")),
    keras.optimizers.SGD: (_sgd, ("momentums",)),
}
