"""Keras callbacks, as users pass them to ``fit``, called at the framework's events.

``train`` and ``train_and_evaluate`` take ``callbacks=[...]`` (gin:
``experiment.callbacks``): ``keras.callbacks.Callback`` objects, unchanged. The
framework trains in compiled blocks of steps, so its events are these, with ``fit``'s
names and arguments:

* ``on_train_begin(logs)``: once per call, after the model is built and restored;
* ``on_epoch_begin(epoch, logs)`` and ``on_epoch_end(epoch, logs)``: an epoch is an
  evaluation cycle of ``train_and_evaluate`` (``eval_every_steps`` steps; the last may
  be shorter), or a log period (``log_every_steps``) of ``train``, which does not
  evaluate. Epoch ``k`` ends at step ``(k + 1) * period``. Its logs are named as
  ``fit`` names them: the epoch's training metrics (``loss``, ``accuracy``, ...: each
  the mean over the epoch's steps), then ``val_loss``,
  ``val_accuracy``, ... of the first eval set and ``val_<set>_<metric>`` of the others;
* ``on_train_batch_begin(batch, logs)`` and ``on_train_batch_end(batch, logs)``: around each
  compiled block (a block ends at each log step), ``batch`` being the index in its
  epoch of the block's last step; the logs are the training metrics since the last
  log step;
* ``on_test_begin(logs)`` and ``on_test_end(logs)``: around each eval set's evaluation
  (``logs``: its metrics);
* ``on_checkpoint(step, path)``, the framework's own, on callbacks that define it:
  after each checkpoint but the last;
* ``on_train_end(logs)``: after the last evaluation (the last epoch's logs), before
  the last checkpoint, which holds the weights callbacks put back then.

``callback.model`` is the Keras model trained, or for a ``ModelFn`` a ``CallbackModel``
(its weights, ``stop_training`` and optimizer). Setting ``model.stop_training = True``
ends the run after the block, with a checkpoint; a learning rate set on the optimizer
is the one the next step uses. Under several workers the callbacks run on the chief,
which hands its stop and learning rates to the others after each block.

A callback's state (EarlyStopping's ``wait`` and ``best``, ReduceLROnPlateau's, a
CSVLogger's columns) is kept in ``model_dir/callbacks/<step>.npz`` after each checkpoint
and each epoch: a resumed run takes it back, as of the checkpoint it resumes from, and
fires no event again for a step that the checkpoint holds. A callback takes back the
state of the one at its place in the list if it is made alike (its class and settings);
one given to a second ``train`` call in the same process begins afresh, as in a second
``fit``. What can work only inside
``fit`` is refused in one line naming the framework's way (``REFUSED``).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import keras
import numpy as np
import tensorflow as tf

from trainer import callback_state, internals
from trainer.errors import UserError
from trainer.metrics import EpochMetrics

REFUSED = {  # Keras callback: what the framework does instead
    "ModelCheckpoint": "the framework checkpoints model_dir itself (Checkpoints.every_steps, "
    "Checkpoints.keep; BestExport for the best model)",
    "BackupAndRestore": "the framework resumes from model_dir's newest checkpoint, at the exact "
    "batch: rerun the same command",
    "TensorBoard": "the framework writes TensorBoard event files to model_dir (Summaries for "
    "histograms, images and the profiler)",
    "ProgbarLogger": "the Estimator's progress=True shows a progress bar",
    "SwapEMAWeights": "Optimization.ema_decay: evaluations and exports use the moving average",
}
AUXILIARY = ("gradient_norm", "steps_per_sec", "examples_per_sec", "input_wait_share")
_BEGUN: weakref.WeakSet = weakref.WeakSet()  # the callbacks this process has begun


def checked(callbacks: Sequence[Any] | None) -> list[keras.callbacks.Callback]:
    """The callbacks as a list; refuses what is not one, or what works only in ``fit``."""
    if callbacks is None:
        return []
    if isinstance(callbacks, keras.callbacks.Callback) or not isinstance(
        callbacks, Sequence | tuple | list
    ):
        callbacks = [callbacks]
    for callback in callbacks:
        name = getattr(callback, "__name__", None)
        if name in REFUSED and callable(callback):  # gin's @callbacks.ModelCheckpoint
            raise UserError(refusal(name))
        if isinstance(callback, type) and issubclass(callback, keras.callbacks.Callback):
            raise UserError(
                f"callbacks takes keras.callbacks.Callback objects, got the class {name} "
                f"(in gin, write @callbacks.{name}() with parentheses)"
            )
        if not isinstance(callback, keras.callbacks.Callback):
            raise UserError(
                f"callbacks takes keras.callbacks.Callback objects, got {type(callback).__name__} "
                f"{callback!r:.60}: subclass keras.callbacks.Callback, or wrap a function in "
                "keras.callbacks.LambdaCallback"
            )
        for cls in type(callback).__mro__:
            if cls.__module__.startswith("keras") and cls.__name__ in REFUSED:
                raise UserError(refusal(cls.__name__))
    return list(callbacks)


def refusal(name: str) -> str:
    """The one line for Keras callback ``name``, which works only inside ``fit``."""
    return f"keras.callbacks.{name} works only inside model.fit: {REFUSED[name]}"


def refused_in_gin(name: str) -> Callable[..., NoReturn]:
    """What gin's ``@callbacks.<name>()`` makes of a callback ``REFUSED`` names.

    Its one line, whatever it is given (``ModelCheckpoint`` without its filepath too).
    """

    def refuse(*args, **kwargs):
        del args, kwargs
        raise UserError(refusal(name))

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


RATE_SETTERS = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler)


def check_rates_settable(callbacks: Sequence, units: Sequence) -> None:
    """Refuses, before training, a callback that sets a learning rate that is a schedule.

    Keras cannot set one (``fit`` fails alike, at the first change); a multiplier rule
    (``Optimization.learning_rate_multipliers``) makes its variables' rate a schedule.
    """
    setter = next((c for c in callbacks if isinstance(c, RATE_SETTERS)), None)
    if setter is None:
        return
    for unit in units:
        optimizer = getattr(unit.optimizer, "inner_optimizer", unit.optimizer)
        given = optimizer.get_config()["learning_rate"]
        if not isinstance(given, dict):  # a number (a schedule is serialised as a dict)
            continue
        what = type(setter).__name__
        if getattr(unit, "rate", None) is not None:
            raise UserError(
                f"keras.callbacks.{what} sets the optimizer's learning rate, which "
                "Optimization.learning_rate_multipliers makes a schedule per rule, and Keras "
                "cannot set a schedule: drop the multipliers or the callback"
            )
        raise UserError(
            f"keras.callbacks.{what} sets the optimizer's learning rate, but "
            f"{type(optimizer).__name__}'s is a schedule ({given.get('class_name')}), which "
            "Keras cannot set (fit fails alike): give the optimizer a number, or drop the "
            "callback"
        )


class CallbackModel:
    """``callback.model`` for a ``ModelFn``: its weights, ``stop_training`` and optimizer.

    Args:
      variables: returns the model's variables, trainable first, in a fixed order.
      trainable: how many of them are trainable.
      optimizer: the Keras optimizer (with optimizer groups, an object whose
        ``optimizers`` are the groups', as Keras's ``ReduceLROnPlateau`` expects).
    """

    def __init__(self, variables: Callable[[], list], trainable: int, optimizer):
        self._variables, self._trainable = variables, trainable
        self.optimizer = optimizer
        self.stop_training = False
        self.metrics: list = []

    @property
    def weights(self) -> list:
        """Every variable of the model (trainable first)."""
        return self._variables()

    @property
    def trainable_weights(self) -> list:
        """The variables training updates."""
        return self._variables()[: self._trainable]

    def get_weights(self) -> list[np.ndarray]:
        """The weights' values, as ``keras.Model.get_weights`` gives them."""
        return [np.array(v.numpy()) for v in self._variables()]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Assigns values got by ``get_weights``."""
        for variable, value in zip(self._variables(), weights, strict=True):
            variable.assign(value)


class WithOptimizer:
    """A Keras model, its ``optimizer`` replaced by the one that trains it; the rest its own."""

    def __init__(self, model: keras.Model, optimizer):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "optimizer", optimizer)

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._model, name, value)  # stop_training, say


class Groups:
    """``callback.model.optimizer`` under optimizer groups: each group's optimizer."""

    def __init__(self, optimizers: Sequence):
        self.optimizers = list(optimizers)


def callback_model(model_fn, units: Sequence) -> Any:
    """What ``callback.model`` is: the Keras model, or a ``CallbackModel``.

    ``units`` are the optimizers training uses (``optimizer_groups.Unit``). A Keras
    model compiled with another optimizer than the Estimator's is seen through
    ``WithOptimizer``, whose ``optimizer`` is the one that trains.
    """
    optimizer = units[0].optimizer if len(units) == 1 else Groups([u.optimizer for u in units])
    keras_model = getattr(model_fn, "model", None)
    if isinstance(keras_model, keras.Model):
        keras_model.stop_training = False
        if getattr(keras_model, "optimizer", None) is optimizer:
            return keras_model
        return WithOptimizer(keras_model, optimizer)
    trainable = list(model_fn.trainable_variables)
    return CallbackModel(
        lambda: trainable + list(model_fn.non_trainable_variables), len(trainable), optimizer
    )


def set_direction(callback: keras.callbacks.Callback) -> None:
    """Decides now whether a monitored metric should grow, as ``fit`` does at epoch end.

    Keras's ``mode='auto'`` looks for the metric among a fit-built model's metrics; here
    the metric's name is looked up among Keras's metrics (``accuracy``, ``auc``, ``mae``)
    instead, and a name that says nothing is refused now, not after the first epoch.
    """
    if getattr(callback, "monitor_op", "absent") is not None:
        return
    name = callback.monitor.removeprefix("val_")
    mode = getattr(callback, "mode", "auto")
    if mode == "auto" and name.endswith("loss"):
        mode = "min"
    elif mode == "auto":
        try:  # compile() takes "acc" for accuracy too
            metric = keras.metrics.get("accuracy" if name == "acc" else name)
            mode = {"up": "max", "down": "min"}[internals.metric_direction(metric)]
        except (ValueError, KeyError, AttributeError, TypeError):
            raise UserError(
                f"{type(callback).__name__}(monitor={callback.monitor!r}) cannot tell whether "
                f"a higher {callback.monitor} is better: pass mode='max' or mode='min'"
            ) from None
    callback.mode, given = mode, callback.mode
    try:
        internals.set_monitor_op(callback)
    finally:
        callback.mode = given


class Events:
    """Calls the callbacks at the loop's events and keeps their state by step.

    Args:
      callbacks: Keras callbacks (``checked``).
      epoch_steps: the steps of an epoch; None for one epoch to ``max_steps``.
      epochs_at_logs: each log step ends an epoch (``train``, which has no evaluations).
      model_dir: where their state is kept.
      workers: the run's workers (``OneProcess`` or ``Workers``); they run on the chief.
    """

    def __init__(
        self,
        callbacks: Sequence | None,
        epoch_steps: int | None,
        epochs_at_logs: bool,
        model_dir: str,
        workers,
        chief: bool,
    ):
        self.callbacks = checked(callbacks)
        self.epoch_steps, self.epochs_at_logs = epoch_steps, epochs_at_logs
        self.model_dir, self.workers, self.chief = model_dir, workers, chief
        self.model: Any = None
        self.units: Sequence = ()
        self.running: Callable[[], dict] = dict
        self.flush: Callable[[int], None] = lambda step: None
        self.fresh: dict[str, dict] = {}  # each callback's state once begun
        self.epoch = _EpochLogs()
        self.logged_at = -1  # the last log step
        self.last_epoch: dict = {}  # the last epoch's logs: on_train_end's
        self.nan_step: int | None = None  # the step whose loss was NaN, which ended it
        self.ema = None  # the weights' moving average (Optimization.ema_decay), or None
        self.best_averages: dict[str, dict] = {}  # by EarlyStopping: its best epoch's
        self.streamed = EpochMetrics()  # the epoch's streamed training metrics (AUC)

    @property
    def live(self) -> bool:
        """Whether callbacks run in this process (begun, and the chief)."""
        return bool(self.callbacks) and self.chief and self.model is not None

    def begin(
        self,
        step: int,
        max_steps: int,
        model_fn,
        units: Sequence,
        running,
        flush,
        ema=None,
        streamed: EpochMetrics | None = None,
    ) -> None:
        """Training starts at ``step``: callbacks get the model, params and their saved state.

        ``units`` are the optimizers (``optimizer_groups.Unit``); ``running()`` gives the
        training metrics since the last log step; ``flush(step)`` runs the log action (an
        epoch ends with a log step). ``ema``: the weights' moving average, which
        evaluations use: EarlyStopping's best weights put back bring their average back.
        ``streamed``: the training step's streamed metrics (AUC), read and reset by epoch.
        """
        if not self.callbacks:
            return
        self.ema = ema
        self.streamed = streamed or EpochMetrics()
        self.streamed.reset()
        check_rates_settable(self.callbacks, units)
        self.model, self.units = callback_model(model_fn, units), units
        self.running, self.flush = running, flush
        self.epoch = _EpochLogs(at=step)
        self.logged_at = step
        if not self.chief:
            return
        period = self.epoch_steps or max_steps
        params = {"epochs": -(-max_steps // period), "steps": period, "verbose": 0}
        saved = callback_state.read(self.model_dir, step)
        configs = saved.get("__config__", {})
        self.best_averages = dict(saved.get("__best_averages__", {}))
        for key, callback in self._keyed():
            callback.set_model(self.model)
            callback.set_params(params)
            again = callback in _BEGUN  # a second train call with it: fit's begins afresh
            _BEGUN.add(callback)
            resumed = key in saved and not again
            if resumed and isinstance(callback, keras.callbacks.CSVLogger):
                callback.append = True  # a resumed run adds rows to the file it began
            callback.on_train_begin({})
            if hasattr(callback, "monitor"):
                set_direction(callback)
            self.fresh[key] = copy.deepcopy(callback_state.of(callback))
            if resumed and callback_state.same(configs.get(key, self.fresh[key]), self.fresh[key]):
                for name, value in saved[key].items():  # a run stopped part way goes on
                    setattr(callback, name, value)
            else:
                self.best_averages.pop(key, None)  # begun afresh
        if "__epoch__" in saved:
            self.epoch = _EpochLogs(**saved["__epoch__"])

    def block_begin(self, step: int) -> None:
        """A block of steps starts after ``step``; an epoch may begin with it."""
        if not self.live:
            return
        if step % self.epoch_steps == 0 if self.epoch_steps else step == 0:
            self._call("on_epoch_begin", self._epoch_of(step + 1), {})
        self._call("on_train_batch_begin", self._batch_of(step + 1), {})

    def log(self, step: int, logs: Mapping[str, float]) -> None:
        """The log action's logs at ``step``: part of the epoch's; an epoch of ``train`` ends."""
        if not self.callbacks:
            return
        self.epoch.add(step, logs)
        self.logged_at = step
        if self.epochs_at_logs:
            self.epoch_end(step, {})

    @property
    def terminate_on_nan(self) -> bool:
        """Whether a ``TerminateOnNaN`` is given: it, not the NaN guard, ends the run."""
        return any(isinstance(c, keras.callbacks.TerminateOnNaN) for c in self.callbacks)

    def block_end(self, step: int, nan_loss: bool = False) -> None:
        """A block ended at ``step``, before the actions due there (log, save, evaluate).

        ``nan_loss``: the block ended at a step whose loss was NaN or Inf (not counted):
        the logs say ``loss: nan``, as ``fit``'s do, for ``TerminateOnNaN``.
        """
        if not self.callbacks or self.model is None:
            return
        logs = self.running()  # every worker reads (a collective under multi_worker)
        if nan_loss:  # the batch is that of the step not counted, as fit numbers it
            logs, step = {**logs, "loss": float("nan")}, step + 1
            self.nan_step = step
        if self.live:
            self._call("on_train_batch_end", self._batch_of(step), logs)

    def stopped(self) -> bool:
        """After the evaluations at a block's end: True if a callback stopped training.

        Under several workers the chief's stop and learning rates go to the others.
        """
        if not self.callbacks or self.model is None:
            return False
        return self._agreed(bool(getattr(self.model, "stop_training", False)) if self.chief else 0)

    def evaluation(self, evaluate: Callable[[str], dict]) -> Callable[[str], dict]:
        """``evaluate(name)`` between ``on_test_begin`` and ``on_test_end``."""

        def evaluated(name: str) -> dict:
            if self.live:
                self._call("on_test_begin", {})
            metrics = evaluate(name)
            if self.live:
                self._call("on_test_end", dict(metrics))
            return metrics

        return evaluated

    def epoch_end(self, step: int, results: Mapping[str, Mapping[str, float]]) -> None:
        """An epoch ended at ``step`` with these evaluations (by eval set, the first first).

        Its training logs are complete: ``step`` is made a log step if it is not one.
        """
        if not self.callbacks or self.model is None:
            return
        if self.logged_at != step:  # every worker logs (reading metrics is a collective)
            self.flush(step)
        streamed = self.streamed.result()  # every worker reads them too
        self.streamed.reset()
        if not self.live:
            return
        logs = self.epoch.result() | streamed
        for i, (name, metrics) in enumerate(results.items()):
            prefix = "val_" if i == 0 else f"val_{name}_"
            logs.update({prefix + k: float(v) for k, v in metrics.items()})
        self.epoch = _EpochLogs(at=step)
        epoch = self._epoch_of(step)
        if self.nan_step is not None:  # the epoch of the NaN step, whose loss it ends with
            epoch, logs = self._epoch_of(self.nan_step), {**logs, "loss": float("nan")}
            self.nan_step = None
        self._call("on_epoch_end", epoch, logs)
        self.last_epoch = logs
        self._note_best_averages()
        self._keep(step)

    def saved(self, step: int, path: str) -> None:
        """A checkpoint of ``step`` was written to ``path``: the callbacks' state is kept."""
        if self.live:
            for callback in self.callbacks:
                if hasattr(callback, "on_checkpoint"):
                    callback.on_checkpoint(step, path)
            self._keep(step)

    def end(self, step: int) -> None:
        """Training is over at ``step``."""
        if self.live:
            self._call("on_train_end", dict(self.last_epoch))
            self._put_back_best_averages()
            self._keep(step)
        self.model = None  # no event after this one

    def _restorers(self):
        """The EarlyStoppings that put their best weights back, by key, if there is an EMA."""
        if self.ema is None:
            return []
        return [
            (key, c)
            for key, c in self._keyed()
            if isinstance(c, keras.callbacks.EarlyStopping) and c.restore_best_weights
        ]

    def _note_best_averages(self) -> None:
        """Keeps the moving average as of each EarlyStopping's best epoch (it was measured)."""
        for key, callback in self._restorers():
            known = self.best_averages.get(key, {}).get("epoch")
            if callback.best_weights is not None and callback.best_epoch != known:
                averages = [np.array(a) for a in self.ema.averages]
                self.best_averages[key] = {"epoch": callback.best_epoch, "averages": averages}

    def _put_back_best_averages(self) -> None:
        """Puts the best epoch's average back after EarlyStopping put its weights back.

        The average is what the last evaluation and the exports use.
        """
        for key, callback in self._restorers():
            kept = self.best_averages.get(key)
            if callback.best_weights is not None and kept:
                for average, value in zip(self.ema.averages, kept["averages"], strict=True):
                    average.assign(value)

    def _call(self, event: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(*args)

    def _epoch_of(self, step: int) -> int:
        """The epoch that step ``step`` (counted from 1) belongs to."""
        return (step - 1) // self.epoch_steps if self.epoch_steps else 0

    def _batch_of(self, step: int) -> int:
        """Step ``step``'s index in its epoch."""
        return step - 1 - self._epoch_of(step) * (self.epoch_steps or 0)

    def _keyed(self):
        return [(f"{i}:{type(c).__name__}", c) for i, c in enumerate(self.callbacks)]

    def _keep(self, step: int) -> None:
        """Keeps the callbacks' state as of ``step``; drops what no checkpoint needs."""
        state = {
            key: callback_state.changed(callback_state.of(callback), self.fresh.get(key, {}))
            for key, callback in self._keyed()
        }
        state["__epoch__"] = self.epoch.state()
        state["__best_averages__"] = self.best_averages
        state["__config__"] = self.fresh  # whose state it is: a callback made alike takes it
        callback_state.write(self.model_dir, step, state)

    def _agreed(self, stop: int) -> bool:
        """The chief's stop and learning rates, taken by every worker (one all-gather)."""
        if not self.workers.several:
            return bool(stop)
        rates = [_bits(u.optimizer.learning_rate) for u in self.units]
        chief = self.workers.gather([int(stop), *rates])[0]
        if not self.chief:
            for unit, bits, mine in zip(self.units, chief[1:], rates, strict=True):
                if bits != mine:
                    unit.optimizer.learning_rate = float(np.int64(bits).view(np.float64))
        return bool(chief[0])


def _bits(learning_rate) -> int:
    """A learning rate's float64 bits as an int64, to cross workers exactly."""
    return int(np.float64(tf.convert_to_tensor(learning_rate).numpy()).view(np.int64))


class _EpochLogs:
    """The epoch's training logs: each metric's mean over the steps of its log periods.

    As in ``fit``'s, no learning rate: ReduceLROnPlateau and LearningRateScheduler add
    ``learning_rate`` themselves.
    """

    def __init__(self, at: int = 0, sums: dict | None = None, steps: int = 0, last=None):
        del last  # the learning rates an older saved state holds: not a log of fit's
        self.at = at  # the last log step counted (the epoch's start, before any)
        self.sums, self.steps = dict(sums or {}), steps

    def add(self, step: int, logs: Mapping[str, float]) -> None:
        """A log period ending at ``step``: its means count for its steps."""
        n, self.at = step - self.at, step
        for key, value in logs.items():
            if not key.startswith("learning_rate") and key.split("/")[0] not in AUXILIARY:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * n
        self.steps += n

    def result(self) -> dict[str, float]:
        """The means."""
        return {k: v / self.steps for k, v in self.sums.items()} if self.steps else {}

    def state(self) -> dict:
        """What rebuilds it after a resume."""
        return {"at": self.at, "sums": self.sums, "steps": self.steps}
