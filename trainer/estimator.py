"""The Estimator: train, evaluate, predict, export and train_and_evaluate over a ModelFn.

The Estimator holds one model_dir's parts and lends them to the module that does
each job: ``distribution.Placement`` (devices), ``model_state.ModelState`` (the
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
from absl import logging

from trainer import (
    checkpoints,
    errors,
    evaluation,
    export,
    hooks,
    keras_compile,
    logs,
    precision,
    rules,
    saving,
    serving,
    training,
)
from trainer.distribution import Placement
from trainer.inputs import InputFn, Inputs
from trainer.keras_model import KerasModel
from trainer.model_fn import Mode, ModelFn
from trainer.model_state import ModelState
from trainer.step import split_element
from trainer.summaries import Writers
from trainer.writer_lock import WriterLock

# Settings that may change between runs of one model_dir: how often, where and
# on what devices, not what is trained. The CLI refuses a change of any other
# binding under a checkpoint (``gin_config.check_resumable``).
RESUMABLE_SETTINGS = (
    "log_every_steps",
    "save_checkpoints_steps",
    "keep_checkpoint_max",
    "keep_checkpoint_every_steps",
    "keep_best_checkpoints",
    "async_checkpoints",
    "steps_per_loop",
    "eval_batch_size",
    "nonfinite_loss",
    "max_rollbacks",
    "export_best_metric",
    "export_best_keep",
    "export_best_higher",
    "early_stopping_metric",
    "early_stopping_patience",
    "early_stopping_higher",
    "write_graph",
    "histogram_every_steps",
    "image_every_steps",
    "distribution",
    "num_devices",
    "startup_timeout",
    "progress_timeout",
    "prefetch_to_device",
    "microbatches",  # the same update, in less memory: resume with more after running out
    "progress",
)


def _speaking(method):
    """The call shows what the command line shows (``logs.speaking``) unless progress=False."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with logs.speaking(self.settings.progress and self.placement.worker is None):
            return method(self, *args, **kwargs)

    return call


class Estimator:
    """Trains, evaluates, predicts with a ``ModelFn``, keeping all state in ``model_dir``.

    Args:
      model_fn: the model (a ``ModelFn`` instance).
      model_dir: directory for checkpoints, event files and the operative config.
        Rerunning with the same ``model_dir`` resumes from its newest checkpoint.
      optimizer: a Keras optimizer; its learning rate may be a schedule. Default Adam.
        For a model with ``optimizer_groups``, a dict of one per group (one optimizer
        gives each group a copy of it).
      global_batch_size: examples per training step over all devices and workers.
      eval_batch_size: examples per eval/predict batch; defaults to ``global_batch_size``.
      steps_per_loop: most steps run per compiled call; blocks are cut short so that
        logging, checkpoints and evaluation still happen at the steps asked for.
      log_every_steps: how often to write train scalars and print progress.
      save_checkpoints_steps: how often to checkpoint (also always at the end).
      keep_checkpoint_max: how many recent checkpoints to keep.
      keep_checkpoint_every_steps: also keep, for good, a checkpoint at every multiple
        of this step (saved there if the cadence would not); the same on every restart.
      keep_best_checkpoints: also keep the checkpoints of the best exports (those
        ``export_best_metric`` ranks; it must be set), each listed by its step.
      async_checkpoints: write checkpoints in the background, training waiting only
        while the values are copied; None (default) does where it is safe (one device,
        or towers; not under a tf.distribute strategy).
      seed: seed given to input_fns (shuffling); None for nondeterministic input.
      checkpoint_input: resume the training input at the exact next batch instead of
        restarting the data: a positioned dataset (``datasets/`` pipelines) by its
        position (see ``trainer/inputs.py``), any other by saving its iterator.
      clip_gradient_norm: clip the gradients to this global norm before applying them
        (each loss's, for a model with a loss per optimizer group).
      learning_rate_multipliers: ``{pattern: factor}``: the variables whose Keras path
        matches ``pattern`` (``re.search``) train at ``factor`` times the rate.
      frozen_until_step: ``{pattern: step}``: the variables matching ``pattern`` are not
        updated before global step ``step``.
      no_weight_decay: patterns of variables left out of the optimizer's decoupled
        weight decay (AdamW's), e.g. ``['bias', 'norm']``.
      jit_compile: compile each block of training steps with XLA as one computation
        (its batches are read first and stacked, at most ``step.STACKED_BYTES`` of them).
        Faster for dense models on CPU, slower for convolutions there; measure with
        benchmarks/throughput.py. Needs training batches of one fixed shape.
      microbatches: take each training batch in this many slices, one after another
        inside the step, and apply their summed gradients as one update: a batch
        whose activations do not fit in memory trains as the whole batch would
        (models without batch statistics), each step still one step
        (``trainer/microbatch.py``).
      ema_decay: keep an exponential moving average of the weights with this decay
        and evaluate and predict with it (e.g. 0.999); None for no average.
      nonfinite_loss: what a NaN or infinite training loss does: ``'stop'`` ends the
        run (TrainingDiverged) leaving the last checkpoint untouched; ``'rollback'``
        restores the last checkpoint and skips the offending batch.
      max_rollbacks: rollbacks allowed in one run before giving up.
      profile_steps: ``(start, stop)``: record a TensorFlow profiler trace of the steps
        between these global steps into ``model_dir/train`` (TensorBoard's Profile tab).
      write_graph: write the compiled training step's graph to TensorBoard (once).
      histogram_every_steps: write a histogram of every weight this often (None: off).
      image_every_steps: write eval images labelled with predicted and true class this
        often (classifiers with an ``image`` feature; None: off).
      early_stopping_metric: in train_and_evaluate, stop (with a checkpoint) once this
        metric of the first eval set has not improved for ``early_stopping_patience``
        evaluations in a row.
      early_stopping_patience: evaluations without improvement before stopping.
      early_stopping_higher: True when a higher metric is better.
      warm_start_from: where to take initial weights from when ``model_dir`` has no
        checkpoint of its own: a checkpoint, a model_dir, a SavedModel directory or a
        ``.keras`` file (``trainer/warm_start.py``); the optimizer starts fresh.
      warm_start_pattern: regular expression; only weights whose Keras path matches
        it (``re.search``) are taken, e.g. ``'^conv'`` for the convolutions.
      warm_start_map: ``{pattern: replacement}`` renaming this model's variables into
        the source's (``re.sub``, the first pattern that matches).
      export_best_metric: in train_and_evaluate, export a SavedModel whenever this
        metric of the first eval set ranks among the best ``export_best_keep`` so far,
        to ``model_dir/export/best/<step>`` (the ranking survives restarts).
      export_best_keep: how many best exports to keep.
      export_best_higher: True when a higher metric is better (accuracy), False for
        lower (loss).
      config_text_fn: returns the run's configuration as text; written to
        ``model_dir/operative_config.gin`` and to TensorBoard once training starts.
      config_guard: ``guard(saved_text, new_text)`` called before resuming from a
        checkpoint; raises UserError when the change is not safe to resume with.
      distribution: how several devices share a step: ``'auto'`` (all-reduce over
        several GPUs, towers otherwise), ``'towers'`` (each batch split over this
        process's devices), ``'mirrored'`` (tf.distribute.MirroredStrategy) or
        ``'multi_worker'`` (over the machines in ``TF_CONFIG``); see
        ``trainer/distribution.py``.
      num_devices: ``'auto'`` (every GPU, else one CPU) or how many devices to use.
      startup_timeout: under ``'multi_worker'``, seconds to wait for every worker to
        join before giving up, naming the ones that never came (exit 75).
      progress_timeout: under ``'multi_worker'``, seconds in which no worker makes
        progress (a block of steps, an evaluation, a save) before the run is ended,
        naming the workers behind (exit 75); longer than the longest evaluation.
      mixed_precision: ``'mixed_bfloat16'`` or ``'mixed_float16'`` (with loss scaling)
        to compute in 16 bits, float32 weights, logits and loss; None for float32.
        Call ``set_precision`` before making the model (``python -m trainer`` does).
      prefetch_to_device: copy each batch to the device while the step before it runs;
        None: on when training on one GPU without jit_compile (the only case it
        applies to).
      progress: show what the command line shows: the start line, checkpoints and
        evaluations on stdout, warnings on stderr, training's progress as a live bar
        on a terminal (else a line every ``log_every_steps``), and the full log in
        ``model_dir/trainer.log``; False for silence.
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
        if isinstance(model_fn, keras.Model):  # a Keras model as it is, with its compile()
            optimizer = keras_compile.optimizer(model_fn, optimizer)
            model_fn = KerasModel(model_fn)
        errors.check_instance("model_fn", model_fn, ModelFn, "a trainer.ModelFn or a keras.Model")
        self.settings = training.Settings(
            global_batch_size=global_batch_size,
            steps_per_loop=steps_per_loop,
            log_every_steps=log_every_steps,
            save_checkpoints_steps=save_checkpoints_steps,
            keep_checkpoint_max=keep_checkpoint_max,
            checkpoint_input=checkpoint_input,
            jit_compile=jit_compile,
            nonfinite_loss=nonfinite_loss,
            max_rollbacks=max_rollbacks,
            warm_start_from=warm_start_from,
            warm_start_pattern=warm_start_pattern,
            warm_start_map=dict(warm_start_map or {}),
            profile_steps=tuple(profile_steps) if profile_steps else None,
            write_graph=write_graph,
            histogram_every_steps=histogram_every_steps,
            image_every_steps=image_every_steps,
            progress=progress,
            progress_timeout=progress_timeout,
        )
        self.placement = Placement(
            distribution,
            num_devices,
            global_batch_size=global_batch_size,
            jit_compile=jit_compile,
            prefetch_to_device=prefetch_to_device,
            startup_timeout=startup_timeout,
        )
        self.model_fn = model_fn
        self.model_dir = model_dir  # what every worker restores from
        self.write_dir = self.placement.write_dir(model_dir)  # model_dir but on other workers
        precision.check(model_fn, mixed_precision)
        # Where the time went: input (calling input_fns), building (tracing the
        # model to make its variables), tracing_block (the first block, which also
        # traces and compiles the step), training (every other block), evaluation
        # and checkpoints (saving them).
        self.seconds: collections.Counter = collections.Counter()
        self.config = checkpoints.ConfigRecord(  # every worker checks the chief's record
            model_dir, config_text_fn, config_guard, writes=self.placement.worker is None
        )
        self.model = ModelState(
            model_fn,
            optimizer,
            self.placement,
            self.seconds,
            rules=rules.Rules(
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
        self.checkpoint_policy = saving.policy(
            keep_checkpoint_every_steps,
            keep_best_checkpoints,
            async_checkpoints,
            self.best_exporter,
            distribution=None if self.placement.strategy is None else distribution,
        )

    # ---------------------------------------------------------------- public API

    @_speaking
    def train(self, input_fn: InputFn, max_steps: int, hooks_: Sequence[hooks.Hook] = ()) -> int:
        """Trains until ``global_step`` reaches ``max_steps``, resuming from ``model_dir``.

        Args:
          input_fn: returns the training dataset, repeated as needed.
          max_steps: the global step to stop at (not a number of extra steps).
          hooks_: callables ``hook(step, logs)`` called at every log step.

        Returns:
          The global step reached.
        """
        return self._train(input_fn, max_steps, extra=[], hooks_=hooks_)

    @_speaking
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
            self.model.build(dataset.element_spec, Mode.EVAL)
            self.model.restore_for_inference(self.model_dir, checkpoint)
        return self._evaluate(dataset, steps, name)

    def predict(self, input_fn: InputFn, checkpoint: int | None = None) -> Iterator[dict[str, Any]]:
        """One dict of numpy predictions per example of ``input_fn(PREDICT)``, as they come.

        The model is built and restored now (the checkpoint of step ``checkpoint`` if
        given), so a mistake is raised here, not at the first prediction.
        """
        dataset = self.inputs.dataset(input_fn, Mode.PREDICT)
        steps = self.model.build(dataset.element_spec, Mode.PREDICT)
        self.model.restore_for_inference(self.model_dir, checkpoint)
        return self._predictions(dataset, steps)

    def _predictions(self, dataset: tf.data.Dataset, steps) -> Iterator[dict[str, Any]]:
        for element in errors.guarded(dataset, "predict input"):
            features, _ = split_element(element, Mode.PREDICT)
            with errors.runtime_errors("predict"), self.model.averaged_weights():
                batch = {k: v.numpy() for k, v in steps.predict(features).items()}
            for i in range(len(next(iter(batch.values())))):
                yield {k: v[i] for k, v in batch.items()}

    @_speaking
    def continuous_evaluate(
        self,
        eval_input_fns: InputFn | Mapping[str, InputFn],
        max_steps: int,
        eval_steps: int | None = None,
        poll_seconds: float = 2.0,
        timeout_seconds: float | None = None,
    ) -> dict[str, dict[str, float]]:
        """Evaluates each checkpoint a training job writes, once, until ``max_steps``.

        Runs beside ``train`` (another process, same ``model_dir``), so evaluation
        never pauses training. Checkpoints are taken oldest first; the last evaluated
        step is kept in ``model_dir/continuous_eval.json`` so a restarted evaluator
        resumes. A checkpoint deleted before its turn is skipped with a warning.

        Args:
          eval_input_fns: one input_fn (named ``eval``) or a dict of them.
          max_steps: stop after evaluating a checkpoint at or past this step.
          eval_steps: batches per evaluation; None for the whole eval set.
          poll_seconds: how often to look for new checkpoints.
          timeout_seconds: give up (UserError) after this long without a new checkpoint.

        Returns:
          The metrics of the last evaluation, keyed by eval-set name.
        """
        eval_sets = self.inputs.eval_datasets(eval_input_fns)
        self.model.build(next(iter(eval_sets.values())).element_spec, Mode.EVAL)
        checkpointer = saving.Checkpointer(
            self.model_dir, **self.model.checkpoint_items(optimizer=False)
        )
        results: dict[str, dict[str, float]] = {}
        for path in evaluation.new_checkpoints(
            self.model_dir, max_steps, poll_seconds, timeout_seconds
        ):
            try:
                checkpointer.checkpoint.restore(path).expect_partial()
            except (tf.errors.NotFoundError, ValueError):
                logging.warning("Checkpoint %s was deleted before evaluation: skipped", path)
                continue
            self.model.has_state = True
            results = {n: self._evaluate(d, eval_steps, n) for n, d in eval_sets.items()}
        return results

    @_speaking
    def export(
        self, input_fn: InputFn, export_dir: str | None = None, checkpoint: int | None = None
    ) -> str:
        """Writes a SavedModel whose signatures map examples to predictions (``trainer.serving``).

        Uses the weights in memory after training, otherwise the newest checkpoint or
        that of step ``checkpoint`` (and the moving average of the weights when
        ``ema_decay`` is set).

        Args:
          input_fn: its PREDICT dataset fixes the signature's feature shapes and dtypes.
          export_dir: where to write; default ``model_dir/export/<global step>``.
          checkpoint: the step of the checkpoint to export.

        Returns:
          The export directory.
        """
        dataset = self.inputs.dataset(input_fn, Mode.PREDICT)
        self.model.build(dataset.element_spec, Mode.PREDICT)
        self.model.restore_for_inference(self.model_dir, checkpoint)
        target = export_dir or os.path.join(self.model_dir, "export", str(self.step))
        return self._save_model(dataset, Mode.PREDICT, target)

    def _save_model(self, dataset: tf.data.Dataset, mode: Mode, export_dir: str) -> str:
        """Exports for the features of ``dataset`` and the serving it declares."""
        features_spec, _ = split_element(dataset.element_spec, mode)
        with self.model.averaged_weights():
            return export.save(self.model_fn, features_spec, export_dir, serving.declared(dataset))

    @_speaking
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
          eval_input_fns: one input_fn (its eval set is named ``eval``) or a dict of
            them keyed by eval-set name; each writes to ``model_dir/eval_<name>``.
          max_steps: the global step to stop at.
          eval_every_steps: evaluation cadence in steps; None evaluates only at the end.
          eval_steps: batches per evaluation; None means the whole eval set.

        Returns:
          The final metrics of each eval set, keyed by its name.
        """
        eval_sets = self.inputs.eval_datasets(eval_input_fns)
        first = next(iter(eval_sets.values()))
        evaluations = evaluation.Evaluations(
            lambda name: self._evaluate(eval_sets[name], eval_steps, name),
            list(eval_sets),
            self.best_exporter,
            lambda path: self._save_model(first, Mode.EVAL, path),
            self.early_stopping,
            self._exported,
        )
        self._train(
            train_input_fn,
            max_steps,
            extra=[hooks.Periodic(eval_every_steps, evaluations)],
            # Traced before the first step: a mistake in evaluation is said at once.
            ready=lambda: self.model.build(first.element_spec, Mode.EVAL),
        )
        return evaluations.final(self.step)

    def _exported(self) -> None:
        """The best exports changed: so may the checkpoints kept for them."""
        policy = self.checkpoint_policy
        if policy.keep_best and self.placement.worker is None:
            policy.retention(self.model_dir, self.settings.keep_checkpoint_max).add()

    @property
    def step(self) -> int:
        """The global step: how many training steps the model has taken."""
        return self.model.step

    # ---------------------------------------------------------------- the loop

    def _train(
        self,
        input_fn: InputFn,
        max_steps: int,
        extra: Sequence[hooks.Periodic] = (),
        hooks_: Sequence[hooks.Hook] = (),
        ready: Callable[[], object] | None = None,
    ) -> int:
        with WriterLock(self.write_dir):  # one trainer per model_dir; makes it
            run = training.TrainingRun(
                self.settings,
                self.model,
                self.inputs,
                self.placement,
                self.writers,
                self.model_dir,
                self.config,
                self.checkpoint_policy,
            )
            return run.run(input_fn, max_steps, extra, hooks_, ready)

    def _evaluate(self, dataset: tf.data.Dataset, steps: int | None, name: str) -> dict:
        shows = self.settings.progress and self.placement.worker is None
        return evaluation.evaluate(
            self.model,
            dataset,
            steps,
            name,
            self.writers,
            self.model_dir,
            bar=shows,
            batch_size=self.eval_batch_size,
        )
