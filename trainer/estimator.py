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
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf

from trainer import (
    cadence,
    checkpoint_writer,
    checkpoints,
    errors,
    evaluation,
    export,
    keras_compile,
    logs,
    precision,
    serving,
    training,
    variable_rules,
)
from trainer.distributed.placement import Placement
from trainer.inputs import InputFn, Inputs
from trainer.keras_model import KerasModel
from trainer.model_fn import Mode, ModelFn
from trainer.model_state import ModelState
from trainer.step import split_element
from trainer.summaries import Writers
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
      steps_per_loop: most steps per compiled call (cut short for the actions due).
      log_every_steps: how often to write train scalars and print progress.
      save_checkpoints_steps: how often to checkpoint (also always at the end).
      keep_checkpoint_max: how many recent checkpoints to keep.
      keep_checkpoint_every_steps: also keep, for good, one at every multiple of this.
      keep_best_checkpoints: also keep the checkpoints of the best exports.
      async_checkpoints: write checkpoints in the background; None: where it is safe
        (one device or towers, not under a tf.distribute strategy).
      seed: seed given to input_fns (shuffling); None for nondeterministic input.
      checkpoint_input: resume the training input at the exact next batch, by its
        position (``datasets/`` pipelines) or its saved iterator (``trainer/inputs.py``).
      clip_gradient_norm: clip the gradients (each loss's) to this global norm.
      learning_rate_multipliers: ``{pattern: factor}``: variables whose Keras path
        matches ``pattern`` (``re.search``) train at ``factor`` times the rate.
      frozen_until_step: ``{pattern: step}``: those variables wait until that step.
      no_weight_decay: patterns left out of decoupled weight decay, e.g. ``['bias']``.
      jit_compile: compile each block of steps with XLA (training batches of one
        shape); faster for dense models on CPU: measure (benchmarks/throughput.py).
      microbatches: take each batch in this many slices inside the step, applying
        their summed gradients once: less memory, the same update (but for batch
        statistics, which each slice computes alone; ``trainer/microbatch.py``).
      ema_decay: evaluate and predict with a moving average of the weights (e.g. 0.999).
      nonfinite_loss: on a NaN or infinite loss, ``'stop'`` (TrainingDiverged, the last
        checkpoint kept) or ``'rollback'`` (restore it and skip the batch).
      max_rollbacks: rollbacks allowed in one run before giving up.
      profile_steps: ``(start, stop)`` global steps to trace (TensorBoard's Profile tab).
      write_graph: write the compiled training step's graph to TensorBoard, once.
      histogram_every_steps: write a histogram of every weight this often.
      image_every_steps: write eval images with predicted and true class this often.
      early_stopping_metric: in train_and_evaluate, stop once this metric of the first
        eval set has not improved for ``early_stopping_patience`` evaluations.
      early_stopping_patience: evaluations without improvement before stopping.
      early_stopping_higher: True when a higher metric is better.
      warm_start_from: initial weights for a model_dir without a checkpoint: a
        checkpoint, model_dir, SavedModel or ``.keras`` file (``trainer/warm_start.py``).
      warm_start_pattern: take only the weights whose Keras path matches this.
      warm_start_map: ``{pattern: replacement}`` renaming this model's variables into
        the source's (``re.sub``, the first pattern that matches).
      export_best_metric: in train_and_evaluate, export to ``model_dir/export/best/``
        whenever this metric of the first eval set ranks among the best so far.
      export_best_keep: how many best exports to keep.
      export_best_higher: True when a higher metric is better (accuracy, not loss).
      config_text_fn: the run's config as text, kept in ``model_dir`` and TensorBoard.
      config_guard: ``guard(saved_text, new_text)`` before resuming; raises UserError
        when the change is not safe to resume with.
      distribution: ``'auto'``, ``'towers'`` (each batch split over this process's
        devices), ``'mirrored'`` or ``'multi_worker'`` (the machines of ``TF_CONFIG``);
        see ``trainer/distributed/placement.py``.
      num_devices: ``'auto'`` (every GPU, else one CPU) or how many devices to use.
      startup_timeout: multi_worker: seconds to wait for every worker to join.
      progress_timeout: multi_worker: seconds without progress by some worker before
        the run ends naming it (exit 75); longer than the longest evaluation.
      mixed_precision: ``'mixed_bfloat16'`` or ``'mixed_float16'``; call
        ``set_precision`` before making the model (``python -m trainer`` does).
      prefetch_to_device: copy each batch to the device during the step before it;
        None: on for one GPU without jit_compile (the only case it applies to).
      progress: show what the command line shows (start line, checkpoints, a live
        bar or a line per log step, ``model_dir/trainer.log``); False for silence.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        model_dir: str,
        *,
        optimizer: keras.optimizers.Optimizer | None = None,
        global_batch_size: int = 32,
        eval_batch_size: int | None = None,
        steps_per_loop: int = 100,
        log_every_steps: int = 100,
        save_checkpoints_steps: int | None = 1000,
        keep_checkpoint_max: int = 5,
        keep_checkpoint_every_steps: int | None = None,
        keep_best_checkpoints: bool = False,
        async_checkpoints: bool | None = None,
        seed: int | None = None,
        checkpoint_input: bool = True,
        clip_gradient_norm: float | None = None,
        learning_rate_multipliers: Mapping[str, float] | None = None,
        frozen_until_step: Mapping[str, int] | None = None,
        no_weight_decay: Sequence[str] = (),
        ema_decay: float | None = None,
        jit_compile: bool = False,
        microbatches: int = 1,
        nonfinite_loss: str = "stop",
        max_rollbacks: int = 3,
        profile_steps: tuple[int, int] | None = None,
        write_graph: bool = True,
        histogram_every_steps: int | None = None,
        image_every_steps: int | None = None,
        early_stopping_metric: str | None = None,
        early_stopping_patience: int = 3,
        early_stopping_higher: bool = True,
        warm_start_from: str | None = None,
        warm_start_pattern: str = ".*",
        warm_start_map: Mapping[str, str] | None = None,
        export_best_metric: str | None = None,
        export_best_keep: int = 1,
        export_best_higher: bool = True,
        config_text_fn: Callable[[], str] | None = None,
        config_guard: Callable[[str, str], None] | None = None,
        distribution: str = "auto",
        num_devices: int | str = "auto",
        startup_timeout: float = 300,
        progress_timeout: float = 600,
        mixed_precision: str | None = None,
        prefetch_to_device: bool | None = None,
        progress: bool = True,
    ):
        arguments = locals()  # training.Settings takes its fields from here, by name
        if isinstance(model_fn, keras.Model):  # a Keras model as it is, with its compile()
            optimizer = keras_compile.optimizer(model_fn, optimizer)
            model_fn = KerasModel(model_fn)
        errors.check_instance("model_fn", model_fn, ModelFn, "a trainer.ModelFn or a keras.Model")
        self.settings = training.Settings.of(arguments)
        self.placement = Placement(
            distribution,
            num_devices,
            global_batch_size=global_batch_size,
            jit_compile=jit_compile,
            prefetch_to_device=prefetch_to_device,
            startup_timeout=startup_timeout,
        )
        self.model_fn = model_fn
        self.speaks = progress and self.placement.worker is None  # as the command line does
        self.model_dir = model_dir  # what every worker restores from
        self.write_dir = self.placement.workers.write_dir(
            model_dir
        )  # model_dir but on other workers
        precision.check(model_fn, mixed_precision)
        self.seconds: collections.Counter = collections.Counter()  # by part: cli's summary
        self.config = checkpoints.ConfigRecord(  # every worker checks the chief's record
            model_dir, config_text_fn, config_guard, writes=self.placement.worker is None
        )
        self.model = ModelState(
            model_fn,
            optimizer,
            self.placement,
            self.seconds,
            rules=variable_rules.Rules(
                learning_rate_multipliers or {}, frozen_until_step or {}, no_weight_decay
            ),
            mixed_precision=mixed_precision,
            clip_gradient_norm=clip_gradient_norm,
            ema_decay=ema_decay,
            jit_compile=jit_compile,
            microbatches=microbatches,
            config=self.config,
        )
        self.global_step = self.model.global_step
        self.optimizer = self.model.optimizer  # with optimizer groups, a dict by group
        self.eval_batch_size = eval_batch_size or global_batch_size
        self.inputs = Inputs(
            self.placement, global_batch_size, self.eval_batch_size, seed, self.seconds
        )
        self.writers = Writers(self.write_dir)
        self.best_exporter = evaluation.best_exporter(
            self.write_dir, export_best_metric, export_best_keep, export_best_higher
        )
        self.early_stopping = evaluation.early_stopping(
            early_stopping_metric, early_stopping_patience, early_stopping_higher
        )
        self.checkpoint_policy = checkpoint_writer.policy(
            keep_checkpoint_every_steps,
            keep_best_checkpoints,
            async_checkpoints,
            self.best_exporter,
            distribution=None if self.placement.strategy is None else distribution,
        )

    @logs.speaks
    def train(self, input_fn: InputFn, max_steps: int, hooks_: Sequence[cadence.Hook] = ()) -> int:
        """Trains until ``global_step`` reaches ``max_steps``, resuming from ``model_dir``.

        Args:
          input_fn: returns the training dataset, repeated as needed.
          max_steps: the global step to stop at (not a number of extra steps).
          hooks_: callables ``hook(step, logs)`` called at every log step.

        Returns:
          The global step reached.
        """
        with WriterLock(self.write_dir):  # one trainer at a time; makes model_dir if needed
            return self._training_run().run(input_fn, max_steps, hooks_=hooks_)

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
        self, input_fn: InputFn, export_dir: str | None = None, checkpoint: int | None = None
    ) -> str:
        """Writes a SavedModel mapping examples to predictions (``trainer.serving``); its path.

        ``input_fn``'s PREDICT dataset fixes the signature's feature shapes and dtypes.
        Uses the weights in memory after training, else the newest checkpoint or that
        of step ``checkpoint`` (their moving average with ``ema_decay``). Writes to
        ``export_dir``, by default ``model_dir/export/<global step>``.
        """
        dataset = self.inputs.dataset(input_fn, Mode.PREDICT)
        self.model.for_inference(dataset.element_spec, Mode.PREDICT, self.model_dir, checkpoint)
        target = export_dir or os.path.join(self.model_dir, "export", str(self.step))
        return self._save_model(dataset, Mode.PREDICT, target)

    def _save_model(self, dataset: tf.data.Dataset, mode: Mode, export_dir: str) -> str:
        """Exports for the features of ``dataset`` and the serving it declares."""
        features_spec, _ = split_element(dataset.element_spec, mode)
        with self.model.averaged_weights():
            return export.save(self.model_fn, features_spec, export_dir, serving.declared(dataset))

    @logs.speaks
    def train_and_evaluate(
        self,
        train_input_fn: InputFn,
        eval_input_fns: InputFn | Mapping[str, InputFn],
        max_steps: int,
        eval_every_steps: int | None = None,
        eval_steps: int | None = None,
    ) -> dict[str, dict[str, float]]:
        """Trains to ``max_steps``, evaluating every ``eval_every_steps`` and at the end.

        Args:
          train_input_fn: the training input.
          eval_input_fns: one input_fn (eval set ``eval``) or a dict of them by eval-set
            name; each writes to ``model_dir/eval_<name>``.
          max_steps: the global step to stop at.
          eval_every_steps: evaluation cadence in steps; None evaluates only at the end.
          eval_steps: batches per evaluation; None means the whole eval set.

        Returns:
          The final metrics of each eval set, keyed by its name.
        """
        eval_sets = self.inputs.eval_datasets(eval_input_fns)
        first = next(iter(eval_sets.values()))
        exported = functools.partial(  # a best export may keep its checkpoint
            self.checkpoint_policy.exported, self.model_dir, self.settings.keep_checkpoint_max
        )
        evaluations = evaluation.Evaluations(
            lambda name: self._evaluate(eval_sets[name], eval_steps, name),
            list(eval_sets),
            self.best_exporter,
            lambda path: self._save_model(first, Mode.EVAL, path),
            self.early_stopping,
            exported if self.placement.worker is None else lambda: None,
        )
        with WriterLock(self.write_dir):
            self._training_run().run(
                train_input_fn,
                max_steps,
                extra=[cadence.Periodic(eval_every_steps, evaluations)],
                # Traced before the first step: a mistake in evaluation is said at once.
                ready=lambda: self.model.build(first.element_spec, Mode.EVAL),
            )
        return evaluations.final(self.step)

    @property
    def step(self) -> int:
        """The global step: how many training steps the model has taken."""
        return self.model.step

    def _training_run(self) -> training.TrainingRun:
        """One call of train's run, over this Estimator's parts."""
        return training.TrainingRun(
            self.settings,
            self.model,
            self.inputs,
            self.placement,
            self.writers,
            self.model_dir,
            self.config,
            self.checkpoint_policy,
        )

    def _evaluate(self, dataset: tf.data.Dataset, steps: int | None, name: str) -> dict:
        model, writers, batch_size = self.model, self.writers, self.eval_batch_size
        return evaluation.evaluate(
            model, dataset, steps, name, writers, self.model_dir, self.speaks, batch_size
        )
