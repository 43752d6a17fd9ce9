"""The Estimator: train, evaluate, predict, export and train_and_evaluate over a ModelFn.

The Estimator holds one model_dir's parts and lends them to the module that does
each job: ``placement.Placement`` (devices), ``model_state.ModelState`` (the
model, optimizer and compiled steps), ``inputs.Inputs`` (input_fns and the training
stream's position), ``training.TrainingRun`` (one call of ``train``) and
``evaluation`` (eval sets, best exports, early stopping, side-car polling).
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from trainer import (
    cadence,
    callbacks,
    checkpoint_writer,
    deployment,
    errors,
    evaluation,
    export,
    keras_compile,
    logs,
    precision,
    serving,
    settings,
    tracking,
    training,
)
from trainer import checkpoints as checkpoint_files
from trainer.distributed.placement import Placement
from trainer.inputs import InputFn, Inputs
from trainer.keras_model import KerasModel
from trainer.model_fn import Mode, ModelFn, split_element
from trainer.model_state import ModelState
from trainer.settings import (
    BestExport,
    Checkpoints,
    Devices,
    EarlyStop,
    Optimization,
    RunConfig,
    Summaries,
    WarmStart,
)
from trainer.summaries import Writers
from trainer.warm_start import check_source
from trainer.writer_lock import WriterLock


class Estimator:
    """Trains, evaluates, predicts with a ``ModelFn``, keeping all state in ``model_dir``.

    Args:
      model_fn: the model: a ``ModelFn``, or a (compiled) ``keras.Model``.
      model_dir: checkpoints, event files and the operative config; rerunning with the
        same ``model_dir`` resumes from its newest checkpoint.
      optimizer: a Keras optimizer, its learning rate maybe a schedule (default Adam);
        with ``optimizer_groups``, a dict of one per group (or one copied to each).
      global_batch_size: examples per training step over all devices and workers.
      eval_batch_size: examples per eval/predict batch; default ``global_batch_size``.
      seed: seed given to input_fns (shuffling); None for nondeterministic input.
      steps_per_loop: most steps per compiled call (cut short for the actions due).
      log_every_steps: how often to write train scalars and print progress.
      progress: show what the command line shows (start line, checkpoints, a live
        bar or a line per log step, ``model_dir/trainer.log``); False for silence.
      checkpoints: when to checkpoint and which to keep (``Checkpoints``).
      devices: devices, workers, precision, XLA (``Devices``).
      optimization: clipping, per-variable rates, EMA, micro-batches, NaN policy
        (``Optimization``).
      warm_start: initial weights for a new model_dir (``WarmStart``).
      best_export: train_and_evaluate's best exports (``BestExport``).
      early_stop: train_and_evaluate's early stopping (``EarlyStop``).
      summaries: profiler, graph, histograms and images for TensorBoard (``Summaries``).
      config: the run's config text and its resume guard (``RunConfig``; the command
        line gives gin's).
      tracker: records the run in an experiment tracker (``tracking.MLflow``), from
        the chief.

    Each group is a frozen dataclass of ``trainer/settings.py``, with defaults.
    """

    def __new__(cls, *args, **kwargs):
        """Refuses, by its place now, an argument that moved into a settings group."""
        del args
        moved = sorted(set(kwargs) & set(settings.MOVED))
        if moved:
            raise errors.UserError(settings.moved_argument(moved[0]))
        return super().__new__(cls)

    def __init__(
        self,
        model_fn: ModelFn,
        model_dir: str,
        *,
        optimizer: keras.optimizers.Optimizer | None = None,
        global_batch_size: int = 32,
        eval_batch_size: int | None = None,
        seed: int | None = None,
        steps_per_loop: int = 100,
        log_every_steps: int = 100,
        progress: bool = True,
        checkpoints: Checkpoints = Checkpoints(),
        devices: Devices = Devices(),
        optimization: Optimization = Optimization(),
        warm_start: WarmStart = WarmStart(),
        best_export: BestExport = BestExport(),
        early_stop: EarlyStop = EarlyStop(),
        summaries: Summaries = Summaries(),
        config: RunConfig = RunConfig(),
        tracker: tracking.MLflow | None = None,
    ):
        if isinstance(model_fn, keras.Model):  # a Keras model as it is, with its compile()
            optimizer = keras_compile.optimizer(model_fn, optimizer)
            model_fn = KerasModel(model_fn)
        errors.check_instance("model_fn", model_fn, ModelFn, "a trainer.ModelFn or a keras.Model")
        groups = (checkpoints, devices, optimization, warm_start, best_export, early_stop)
        settings.check(*groups, summaries, config)
        check_source(model_fn, warm_start.source)
        self.loop = training.Loop(global_batch_size, steps_per_loop, log_every_steps, progress)
        self.checkpoints, self.warm_start, self.summaries = checkpoints, warm_start, summaries
        self.placement = Placement(devices, global_batch_size)
        self.model_fn, self.model_dir = model_fn, model_dir  # what every worker restores from
        self.speaks = progress and self.placement.worker is None  # as the command line does
        self.write_dir = self.placement.workers.write_dir(model_dir)  # elsewhere on others
        precision.check(model_fn, devices.mixed_precision)
        self.seconds: collections.Counter = collections.Counter()  # by part: cli's summary
        self.config = checkpoint_files.ConfigRecord(  # every worker checks the chief's record
            model_dir, config.text_fn, config.guard, writes=self.placement.worker is None
        )
        self.model = ModelState(
            model_fn,
            optimizer,
            self.placement,
            self.seconds,
            optimization,
            config=self.config,
            count_classes=summaries.confusion_matrix,
        )
        self.global_step = self.model.global_step
        self.optimizer = self.model.optimizer  # with optimizer groups, a dict by group
        self.eval_batch_size = eval_batch_size or global_batch_size
        batches = (global_batch_size, self.eval_batch_size)
        self.inputs = Inputs(
            self.placement, *batches, seed, self.seconds, self.model.keras_step, model_fn.input_map
        )
        self.tracker = tracker if self.placement.worker is None else None  # the chief's
        if self.tracker is not None:  # its params, unless the command line gave gin's
            self.tracker.bind(model_dir, functools.partial(self._params, (*groups, summaries)))
        self.writers = Writers(self.write_dir, self.tracker)
        self.best_exporter = evaluation.best_exporter(
            self.write_dir, best_export.metric, best_export.keep, best_export.higher
        )
        self.early_stopping = evaluation.early_stopping(
            early_stop.metric, early_stop.patience, early_stop.higher
        )
        self.checkpoint_policy = checkpoint_writer.policy(
            checkpoints.keep_every_steps,
            checkpoints.keep_best,
            checkpoints.background,
            self.best_exporter,
            distribution=None if self.placement.strategy is None else devices.distribution,
        )

    @logs.speaks
    def train(
        self,
        input_fn: InputFn,
        max_steps: int,
        callbacks: Sequence[keras.callbacks.Callback] = (),
    ) -> int:
        """Trains until ``global_step`` reaches ``max_steps``, resuming from ``model_dir``.

        Args:
          input_fn: returns the training dataset, repeated as needed.
          max_steps: the global step to stop at (not a number of extra steps).
          callbacks: Keras callbacks (``trainer.callbacks``); an epoch is a log period.

        Returns:
          The global step reached.
        """
        events = self._events(callbacks, self.loop.log_every_steps, epochs_at_logs=True)
        with tracking.tracked(self.tracker), WriterLock(self.write_dir):  # one trainer at a time
            return self._training_run().run(input_fn, max_steps, events=events)

    @logs.speaks
    def evaluate(
        self,
        input_fn: InputFn,
        steps: int | None = None,
        name: str = "eval",
        checkpoint: int | None = None,
    ) -> dict[str, float]:
        """Evaluates on the whole eval set (or its first ``steps`` batches).

        Uses the weights in memory after ``train``; otherwise restores the newest
        checkpoint, or the one of step ``checkpoint``. Writes the metrics to
        ``model_dir/eval_<name>`` at the global step.

        Returns:
          Mean loss and metrics over every example seen, keyed by metric name.
        """
        dataset = self.inputs.dataset(input_fn, Mode.EVAL)
        if checkpoint is not None:
            self.model.for_inference(dataset.element_spec, Mode.EVAL, self.model_dir, checkpoint)
        return self._evaluate(dataset, steps, name)

    def predict(self, input_fn: InputFn, checkpoint: int | None = None) -> Iterator[dict[str, Any]]:
        """One dict of numpy predictions per example of ``input_fn(PREDICT)``, as they come.

        The model is built and restored now (the checkpoint of step ``checkpoint`` if
        given), so a mistake is raised here, not at the first prediction.
        """
        dataset = self.inputs.dataset(input_fn, Mode.PREDICT)
        steps = self.model.for_inference(
            dataset.element_spec, Mode.PREDICT, self.model_dir, checkpoint
        )
        return evaluation.predictions(self.model, dataset, steps)

    @logs.speaks
    def continuous_evaluate(
        self,
        eval_input_fns: InputFn | Mapping[str, InputFn],
        max_steps: int,
        eval_steps: int | None = None,
        poll_seconds: float = 2.0,
        timeout_seconds: float | None = None,
    ) -> dict[str, dict[str, float]]:
        """Evaluates each checkpoint a training job writes, once, until ``max_steps``.

        Runs beside ``train`` (another process, same ``model_dir``), so evaluation never
        pauses training; oldest checkpoint first, resuming after a restart where it
        stopped (``model_dir/continuous_eval.json``). Every ``poll_seconds`` it looks
        for new checkpoints, giving up (UserError) after ``timeout_seconds`` without
        one. Returns the metrics of the last evaluation, keyed by eval-set name.
        """
        return evaluation.continuous(
            self.model,
            self.model_dir,
            self.inputs.eval_datasets(eval_input_fns),
            lambda dataset, name: self._evaluate(dataset, eval_steps, name),
            evaluation.new_checkpoints(self.model_dir, max_steps, poll_seconds, timeout_seconds),
        )

    @logs.speaks
    def export(
        self,
        input_fn: InputFn,
        export_dir: str | None = None,
        checkpoint: int | None = None,
        formats: Sequence[str] = (),
        eval_input_fn: InputFn | None = None,
    ) -> str:
        """Writes a SavedModel mapping examples to predictions (``trainer.serving``); its path.

        ``input_fn``'s PREDICT dataset fixes the signature's feature shapes and dtypes.
        Uses the weights in memory after training, else the newest checkpoint or that
        of step ``checkpoint`` (their moving average with ``Optimization.ema_decay``). Writes to
        ``export_dir``, by default ``model_dir/export/<global step>``.

        ``formats``: files for deployment written into it too (``trainer.deployment``:
        tflite, tflite_int8, onnx), each run by its runtime on ``eval_input_fn``'s
        EVAL dataset (by default ``input_fn``'s), which also calibrates int8.
        """
        formats = deployment.check_formats(formats)
        dataset = self.inputs.dataset(input_fn, Mode.PREDICT)
        self.model.for_inference(dataset.element_spec, Mode.PREDICT, self.model_dir, checkpoint)
        target = export_dir or os.path.join(self.model_dir, "export", str(self.step))
        evaluated = functools.partial(self.inputs.dataset, eval_input_fn or input_fn, Mode.EVAL)
        replaced = target if export_dir is None and tf.io.gfile.isdir(target) else None
        extras = deployment.extras_for(formats, evaluated, replaced)  # same step: its other files
        path = self._save_model(dataset, Mode.PREDICT, target, extras)
        return deployment.log_exported(path, formats)

    def _save_model(self, dataset: tf.data.Dataset, mode: Mode, export_dir: str, extras=None):
        """Exports for the features of ``dataset`` and the serving it declares."""
        features_spec, _ = split_element(dataset.element_spec, mode)
        declared = serving.declared(dataset)
        with self.model.averaged_weights(), self.model_fn.merged() as model_fn:
            return export.save(model_fn, features_spec, export_dir, declared, extras)

    @logs.speaks
    def train_and_evaluate(
        self,
        train_input_fn: InputFn,
        eval_input_fns: InputFn | Mapping[str, InputFn],
        max_steps: int,
        eval_every_steps: int | None = None,
        eval_steps: int | None = None,
        callbacks: Sequence[keras.callbacks.Callback] = (),
    ) -> dict[str, dict[str, float]]:
        """Trains to ``max_steps``, evaluating every ``eval_every_steps`` and at the end.

        Args:
          train_input_fn: the training input.
          eval_input_fns: one input_fn (eval set ``eval``) or a dict of them by eval-set
            name; each writes to ``model_dir/eval_<name>``.
          max_steps: the global step to stop at.
          eval_every_steps: evaluation cadence in steps; None evaluates only at the end.
          eval_steps: batches per evaluation; None means the whole eval set.
          callbacks: Keras callbacks (``trainer.callbacks``); an epoch ends at each
            evaluation, its logs holding the first eval set's metrics as ``val_<name>``.

        Returns:
          The final metrics of each eval set, keyed by its name.
        """
        events = self._events(callbacks, eval_every_steps, epochs_at_logs=False)
        eval_sets = self.inputs.eval_datasets(eval_input_fns)
        first = next(iter(eval_sets.values()))
        exported = functools.partial(  # a best export may keep its checkpoint
            self.checkpoint_policy.exported, self.model_dir, self.checkpoints.keep
        )
        evaluations = evaluation.Evaluations(
            events.evaluation(lambda name: self._evaluate(eval_sets[name], eval_steps, name)),
            list(eval_sets),
            self.best_exporter,
            lambda path: self._save_model(first, Mode.EVAL, path),
            self.early_stopping,
            exported if self.placement.worker is None else lambda: None,
            events.epoch_end,
        )
        with tracking.tracked(self.tracker):
            with WriterLock(self.write_dir):
                self._training_run().run(
                    train_input_fn,
                    max_steps,
                    # The last evaluation, in the loop: callbacks see it before the end.
                    extra=[
                        cadence.Periodic(eval_every_steps, evaluations),
                        cadence.At((max_steps,), evaluations),
                    ],
                    events=events,
                    ready=functools.partial(self._ready, first, evaluations),
                    epoch_end=evaluations,  # a callback's stop mid-epoch validates, as in fit
                )
            return evaluations.final(self.step)

    @property
    def step(self) -> int:
        """The global step: how many training steps the model has taken."""
        return self.model.step

    def _params(self, groups) -> dict:
        """The tracker's params from Python: the settings groups and the batch size."""
        plain = dict(global_batch_size=self.loop.global_batch_size, seed=self.inputs.run_seed)
        return tracking.settings_params(groups, **plain)

    def _ready(self, first: tf.data.Dataset, evaluations: evaluation.Evaluations) -> None:
        """Restored, before the first step: evaluation traced, early stopping caught up.

        A mistake in evaluation is said at once; a resumed run's early stopping counts
        the evaluations before its checkpoint.
        """
        self.model.build(first.element_spec, Mode.EVAL)
        evaluations.replay(self.writers.metrics.records(f"eval_{evaluations.names[0]}"))

    def _events(self, given, epoch_steps: int | None, epochs_at_logs: bool) -> callbacks.Events:
        """The callbacks of one train or train_and_evaluate call, run on the chief."""
        return callbacks.Events(
            given,
            epoch_steps,
            epochs_at_logs,
            self.write_dir,
            self.placement.workers,
            chief=self.placement.worker is None,
        )

    def _training_run(self) -> training.TrainingRun:
        """One call of train's run, over this Estimator's parts."""
        return training.TrainingRun(
            self.loop,
            self.model,
            self.inputs,
            self.placement,
            self.writers,
            self.model_dir,
            self.config,
            self.checkpoint_policy,
            checkpoints=self.checkpoints,
            warm_start=self.warm_start,
            summaries=self.summaries,
        )

    def _evaluate(self, dataset: tf.data.Dataset, steps: int | None, name: str) -> dict:
        model, writers, batch_size = self.model, self.writers, self.eval_batch_size
        return evaluation.evaluate(
            model, dataset, steps, name, writers, self.model_dir, self.speaks, batch_size
        )


# help(), IDEs and inspect show __init__'s arguments, not __new__'s (*args, **kwargs).
_INIT = inspect.signature(Estimator.__init__)
Estimator.__signature__ = _INIT.replace(parameters=list(_INIT.parameters.values())[1:])
