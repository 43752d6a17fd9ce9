"""The Estimator: train, evaluate, predict and train_and_evaluate over a ModelFn.

Three levels, as in Keras ``fit`` and orbit: this module's Python loop decides
cadence (log, checkpoint, evaluate), ``step.Steps.train_loop`` runs a compiled block
of steps, and one step function touches the model.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
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
    files,
    hooks,
    monitoring,
    precision,
    preemption,
)
from trainer.distribution import Placement
from trainer.divergence import Divergence, check_policy
from trainer.errors import Preempted, TrainingDiverged, UserError
from trainer.inputs import InputFn, Inputs
from trainer.model_fn import Mode, ModelFn, is_positioned
from trainer.model_state import ModelState
from trainer.step import Steps, split_element, stackable_steps
from trainer.summaries import Writers
from trainer.writer_lock import WriterLock

OPERATIVE_CONFIG = "operative_config.gin"


class Estimator:
    """Trains, evaluates, predicts with a ``ModelFn``, keeping all state in ``model_dir``.

    Args:
      model_fn: the model (a ``ModelFn`` instance).
      model_dir: directory for checkpoints, event files and the operative config.
        Rerunning with the same ``model_dir`` resumes from its newest checkpoint.
      optimizer: a Keras optimizer; its learning rate may be a schedule. Default Adam.
      global_batch_size: examples per training step over all devices and workers.
      eval_batch_size: examples per eval/predict batch; defaults to ``global_batch_size``.
      steps_per_loop: most steps run per compiled call; blocks are cut short so that
        logging, checkpoints and evaluation still happen at the steps asked for.
      log_every_steps: how often to write train scalars and print progress.
      save_checkpoints_steps: how often to checkpoint (also always at the end).
      keep_checkpoint_max: how many recent checkpoints to keep.
      seed: seed given to input_fns (shuffling); None for nondeterministic input.
      checkpoint_input: resume the training input at the exact next batch instead of
        restarting the data. A positioned dataset (``trainer.model_fn.positioned``:
        the index-based pipelines of ``datasets/``) is resumed by arithmetic and
        checkpoints hold only how many examples were read; any other dataset's
        iterator is saved in each checkpoint (it needs a pipeline without
        ``py_function``, and its shuffle buffer and cache are saved with it).
      clip_gradient_norm: clip the gradients to this global norm before applying them.
      jit_compile: compile each block of training steps with XLA as one computation
        (its batches are read first and stacked, at most ``step.STACKED_BYTES`` of them).
        Faster for dense models on CPU, slower for convolutions there; measure with
        benchmarks/throughput.py. Needs training batches of one fixed shape.
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
      warm_start_from: a checkpoint (or a model_dir) to take initial weights from when
        ``model_dir`` has no checkpoint of its own; the optimizer starts fresh.
      warm_start_pattern: regular expression; only weights whose Keras path matches
        it (``re.search``) are taken, e.g. ``'^conv'`` for the convolutions.
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
      distribution: how several devices share a step. ``'towers'`` splits each batch
        over the devices (shards may differ by one example), each computing its
        gradients on its own device, and averages them weighted by shard size.
        ``'mirrored'`` uses tf.distribute.MirroredStrategy; ``'multi_worker'``
        MultiWorkerMirroredStrategy over the machines named in ``TF_CONFIG`` (each
        machine's GPUs, or its CPU), with checkpoints and summaries written by the
        chief and each other worker keeping its own copy in ``model_dir/worker_<i>``.
        Under both strategies ``global_batch_size`` must divide evenly over the
        replicas and evaluation runs on each worker's first device. A positioned
        input resumes at its position on any number of devices; any other is resumed
        by skipping the batches already trained on (TF cannot checkpoint a
        distributed iterator).
      num_devices: ``'auto'`` (every GPU, else one CPU) or how many devices to use.
      mixed_precision: ``'mixed_bfloat16'`` (CPUs with AVX-512 BF16, TPUs, recent
        GPUs) or ``'mixed_float16'`` (GPUs; the optimizer is wrapped in a Keras
        LossScaleOptimizer) to compute in 16 bits while keeping float32 weights,
        logits and loss; None for float32. The Keras dtype policy must be set before
        the model is built (``python -m trainer`` does; see ``set_precision``).
      prefetch_to_device: read each batch, and copy it to the device, while the step
        before it runs, so that the copy is off the step's path. None: on when training
        on one GPU (or other accelerator) without jit_compile. It applies to one device:
        strategies prefetch to their replicas themselves, towers copy each shard in the
        step, and jit_compile reads a block's batches before the block.
    """

    # Settings that may change between runs of one model_dir: how often, where and
    # on what devices, not what is trained. The CLI refuses a change of any other
    # binding under a checkpoint (``gin_config.check_resumable``).
    RESUMABLE = (
        "log_every_steps",
        "save_checkpoints_steps",
        "keep_checkpoint_max",
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
        "prefetch_to_device",
    )

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
        seed: int | None = None,
        checkpoint_input: bool = True,
        clip_gradient_norm: float | None = None,
        ema_decay: float | None = None,
        jit_compile: bool = False,
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
        export_best_metric: str | None = None,
        export_best_keep: int = 1,
        export_best_higher: bool = True,
        config_text_fn: Callable[[], str] | None = None,
        config_guard: Callable[[str, str], None] | None = None,
        distribution: str = "towers",
        num_devices: int | str = "auto",
        mixed_precision: str | None = None,
        prefetch_to_device: bool | None = None,
    ):
        check_policy(nonfinite_loss)
        if not isinstance(model_fn, ModelFn):
            raise UserError(
                f"model_fn must be a trainer.ModelFn instance, got {type(model_fn).__name__} "
                "(in gin, write @MyModel() with parentheses to pass an instance)"
            )
        for name, value in [
            ("global_batch_size", global_batch_size),
            ("steps_per_loop", steps_per_loop),
            ("log_every_steps", log_every_steps),
        ]:
            if value < 1:
                raise UserError(f"Estimator.{name} must be >= 1, got {value}")
        self.model_fn = model_fn
        self.placement = Placement(
            distribution,
            num_devices,
            global_batch_size=global_batch_size,
            clip_gradient_norm=clip_gradient_norm,
            jit_compile=jit_compile,
            prefetch_to_device=prefetch_to_device,
        )
        self.model_dir = self.placement.worker_dir(model_dir)
        self.optimizer = optimizer if optimizer is not None else keras.optimizers.Adam()
        precision.check(model_fn, mixed_precision)
        self.optimizer = self.placement.adopt(precision.scaled(self.optimizer, mixed_precision))
        self.global_batch_size = global_batch_size
        self.eval_batch_size = eval_batch_size or global_batch_size
        self.steps_per_loop = steps_per_loop
        self.log_every_steps = log_every_steps
        self.save_checkpoints_steps = save_checkpoints_steps
        self.keep_checkpoint_max = keep_checkpoint_max
        self.seed = seed
        self.checkpoint_input = checkpoint_input
        self.clip_gradient_norm = clip_gradient_norm
        self.ema_decay = ema_decay
        self.jit_compile = jit_compile
        self.nonfinite_loss = nonfinite_loss
        self.max_rollbacks = max_rollbacks
        self.early_stopping = (
            hooks.Patience(early_stopping_metric, early_stopping_patience, early_stopping_higher)
            if early_stopping_metric
            else None
        )
        self.warm_start_from = warm_start_from
        self.warm_start_pattern = warm_start_pattern
        if profile_steps is not None and not 0 <= profile_steps[0] < profile_steps[1]:
            raise UserError(f"profile steps must be start < stop, got {profile_steps}")
        self.profile_steps = tuple(profile_steps) if profile_steps else None
        self.write_graph = write_graph
        self.histogram_every_steps = histogram_every_steps
        self.image_every_steps = image_every_steps
        self.best_exporter = (
            export.BestExporter(
                os.path.join(self.model_dir, "export", "best"),
                export_best_metric,
                export_best_keep,
                export_best_higher,
            )
            if export_best_metric
            else None
        )
        self.config_text_fn = config_text_fn
        self.config_guard = config_guard
        # Where the time went: building (tracing the model to make its variables),
        # tracing_block (the first block, which also traces and compiles the step),
        # training (every other block) and evaluation.
        self.seconds: collections.Counter = collections.Counter()
        self.model = ModelState(
            model_fn,
            self.optimizer,
            self.placement,
            self.seconds,
            clip_gradient_norm=clip_gradient_norm,
            ema_decay=ema_decay,
            jit_compile=jit_compile,
        )
        self.global_step = self.model.global_step
        self.inputs = Inputs(self.placement, global_batch_size, self.eval_batch_size, seed)
        self.writers = Writers(self.model_dir)
        self._graph_written = False

    # ---------------------------------------------------------------- public API

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

    def evaluate(
        self, input_fn: InputFn, steps: int | None = None, name: str = "eval"
    ) -> dict[str, float]:
        """Evaluates on the whole eval set (or its first ``steps`` batches).

        Uses the weights in memory after ``train``; otherwise restores the newest
        checkpoint. Writes the metrics to ``model_dir/eval_<name>`` at the global step.

        Returns:
          Mean loss and metrics over every example seen, keyed by metric name.
        """
        dataset = self.inputs.dataset(input_fn, Mode.EVAL)
        return self._evaluate(dataset, steps, name)

    def predict(self, input_fn: InputFn) -> Iterator[dict[str, Any]]:
        """Yields one dict of numpy predictions per example of ``input_fn(PREDICT)``."""
        dataset = self.inputs.dataset(input_fn, Mode.PREDICT)
        steps = self.model.build(dataset.element_spec, Mode.PREDICT)
        self.model.restore_for_inference(self.model_dir)
        for element in errors.guarded(dataset, "predict input"):
            features, _ = split_element(element, Mode.PREDICT)
            with errors.runtime_errors("predict"), self.model.averaged_weights():
                batch = {k: v.numpy() for k, v in steps.predict(features).items()}
            for i in range(len(next(iter(batch.values())))):
                yield {k: v[i] for k, v in batch.items()}

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
        eval_sets = {
            name: self.inputs.dataset(fn, Mode.EVAL)
            for name, fn in evaluation.eval_sets(eval_input_fns).items()
        }
        self.model.build(next(iter(eval_sets.values())).element_spec, Mode.EVAL)
        checkpointer = checkpoints.Checkpointer(
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

    def export(self, input_fn: InputFn, export_dir: str | None = None) -> str:
        """Writes a SavedModel whose ``serving_default`` maps PREDICT features to predictions.

        Uses the weights in memory after training, otherwise the newest checkpoint (and
        the moving average of the weights when ``ema_decay`` is set).

        Args:
          input_fn: its PREDICT dataset fixes the signature's feature shapes and dtypes.
          export_dir: where to write; default ``model_dir/export/<global step>``.

        Returns:
          The export directory.
        """
        dataset = self.inputs.dataset(input_fn, Mode.PREDICT)
        self.model.build(dataset.element_spec, Mode.PREDICT)
        self.model.restore_for_inference(self.model_dir)
        features_spec, _ = split_element(dataset.element_spec, Mode.PREDICT)
        target = export_dir or os.path.join(self.model_dir, "export", str(self.step))
        return self._save_model(features_spec, target)

    def _save_model(self, features_spec, export_dir: str) -> str:
        with self.model.averaged_weights():
            return export.save(self.model_fn, features_spec, export_dir)

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
        eval_sets = {
            name: self.inputs.dataset(fn, Mode.EVAL)
            for name, fn in evaluation.eval_sets(eval_input_fns).items()
        }
        first = next(iter(eval_sets.values()))
        features_spec, _ = split_element(first.element_spec, Mode.EVAL)
        evaluations = evaluation.Evaluations(
            lambda name: self._evaluate(eval_sets[name], eval_steps, name),
            list(eval_sets),
            self.best_exporter,
            lambda path: self._save_model(features_spec, path),
            self.early_stopping,
        )
        self._train(
            train_input_fn, max_steps, extra=[hooks.Periodic(eval_every_steps, evaluations)]
        )
        return evaluations.final(self.step)

    @property
    def step(self) -> int:
        """The global step: how many training steps the model has taken."""
        return self.model.step

    # ---------------------------------------------------------------- the loop

    def _train(
        self,
        input_fn: InputFn,
        max_steps: int,
        extra: list[hooks.Periodic],
        hooks_: Sequence[hooks.Hook] = (),
    ) -> int:
        tf.io.gfile.makedirs(self.model_dir)
        with WriterLock(self.model_dir):  # one trainer per model_dir
            return self._train_locked(input_fn, max_steps, extra, hooks_)

    def _train_locked(
        self,
        input_fn: InputFn,
        max_steps: int,
        extra: list[hooks.Periodic],
        hooks_: Sequence[hooks.Hook],
    ) -> int:
        run = self._start_training(input_fn)
        if run.start >= max_steps:
            logging.info("global_step %d >= max_steps %d: nothing to train.", run.start, max_steps)
            return run.start
        if run.iterator is None:  # a strategy's, made at the restored position
            run.iterator = self.inputs.train_iterator(input_fn, run.start)
        self._write_config(run.start)
        logging.info(
            "Training %s from step %d to %d in %s",
            type(self.model_fn).__name__,
            run.start,
            max_steps,
            self.model_dir if run.restored else f"new {self.model_dir}",
        )
        log = monitoring.TrainLog(
            run.steps,
            self.writers,
            self.optimizer,
            monitoring.Progress(run.start, max_steps, self.global_batch_size),
            run.input_wait,
            hooks_,
            self.placement.measures_gradient_norm,
        )
        actions = [
            hooks.Periodic(self.log_every_steps, log),
            hooks.Periodic(self.save_checkpoints_steps, run.save),
            *self._tensorboard_actions(input_fn, run.steps),
            *extra,
        ]
        step = self._loop(run, actions, max_steps)
        if not actions[0].is_due(step):  # the end: log and save unless just done
            log(step)
        run.save(step)
        run.input_wait.report()
        return step

    def _start_training(self, input_fn: InputFn) -> _Run:
        """Data, model and optimizer, restored from the newest checkpoint.

        Rerunning the same command continues where it stopped, from the exact next
        batch, unless the configuration changed under the checkpoint. Positioned data
        starts where the checkpoint's input stands (read before restoring, so that the
        dataset is built once).
        """
        self.inputs.resume_from(checkpoints.latest_checkpoint(self.model_dir))
        dataset = self.inputs.dataset(input_fn, Mode.TRAIN)
        run = _Run(input_fn, dataset, self.model.build(dataset.element_spec, Mode.TRAIN))
        run.iterator = self.placement.saved_iterator(dataset)
        state = {**self.model.checkpoint_items(optimizer=True), **self.inputs.state()}
        if self.checkpoint_input and run.iterator is not None and not run.positioned:
            state["input"] = run.iterator
        run.checkpointer = checkpoints.Checkpointer(
            self.model_dir, self.keep_checkpoint_max, **state
        )
        if run.checkpointer.latest is not None:
            self._check_config()
        run.restored = run.checkpointer.restore_latest() is not None
        if not run.restored and self.warm_start_from:
            checkpoints.warm_start(self.model_fn, self.warm_start_from, self.warm_start_pattern)
        self.model.has_state = True
        run.start = self.step
        # Under jit_compile a block's batches are stacked: as many as fit in memory.
        run.block = self.steps_per_loop
        if self.jit_compile:
            run.block = min(run.block, stackable_steps(dataset.element_spec))
        run.input_wait = monitoring.InputWait(run.steps, self.seconds)
        run.check_saved_input = "input" in state  # a saved iterator's size, once
        return run

    def _loop(self, run: _Run, actions: list, max_steps: int) -> int:
        """Compiled blocks of steps, cut where actions are due; returns the step reached."""
        divergence = Divergence(
            self.nonfinite_loss, self.max_rollbacks, run.checkpointer, self.global_step
        )
        step = run.start
        run.steps.train_metrics.reset()
        with preemption.watch_signals() as signals:
            while step < max_steps:
                if divergence.skip_bad_batch(step, run.iterator):
                    self.inputs.advance(1)
                limit = min([run.block, max_steps - step, *divergence.limits(step)])
                n = hooks.steps_until_due(step, actions, limit)
                with run.input_wait.timing(n):
                    self._run_block(run.steps, run.iterator, n)
                resume_at = self._check_finite(divergence, run.steps, step + 1, n)
                if resume_at is not None:  # rolled back, or back to find the bad step
                    step = resume_at
                    run.steps.train_metrics.reset()
                    if run.positioned:  # the restored position, not the iterator's
                        run.iterator = self.inputs.train_iterator(run.input_fn, step)
                    continue
                self.inputs.advance(self.step - step)
                step = self.step
                if hooks.run_due(actions, step):
                    break
                if signals:
                    path = run.checkpointer.save(step)
                    raise Preempted(
                        f"{signals[0]} received: saved {path} at step {step}; rerun the same "
                        "command to resume"
                    )
        return step

    def _check_finite(self, divergence: Divergence, steps: Steps, first: int, n: int):
        """``divergence.check``, marking the weights in memory stale if training diverged.

        The bad step is in them then: evaluate and export restore the checkpoint instead.
        """
        try:
            return divergence.check(steps, first, n)
        except TrainingDiverged:
            self.model.has_state = False
            raise

    def _tensorboard_actions(self, input_fn: InputFn, steps: Steps) -> list:
        """Histograms, labelled images and the profiler, at the steps asked for."""
        actions = monitoring.profiler_actions(
            self.profile_steps, os.path.join(self.model_dir, "train")
        )
        if self.histogram_every_steps or self.image_every_steps:
            batch = next(iter(self.inputs.dataset(input_fn, Mode.EVAL)))
            features, labels = split_element(batch, Mode.EVAL)
        if self.histogram_every_steps:
            write = monitoring.histogram_action(self.writers, self.model_fn, features)
            actions.append(hooks.Periodic(self.histogram_every_steps, write))
        if self.image_every_steps:
            write = monitoring.image_action(self.writers, steps, features, labels)
            actions.append(hooks.Periodic(self.image_every_steps, write))
        return actions

    def _run_block(self, steps: Steps, iterator, n: int) -> None:
        """Runs one compiled block of ``n`` steps; input and runtime errors become one line.

        The first block of a process also writes the step's graph to TensorBoard.
        """
        if self.write_graph and not self._graph_written:
            self._graph_written = True
            with monitoring.graph_written(self.writers.get("train"), self.step):
                return self._run_steps(steps, iterator, n)
        return self._run_steps(steps, iterator, n)

    def _run_steps(self, steps: Steps, iterator, n: int) -> None:
        try:
            with errors.runtime_errors(f"training step {self.step + 1}"):
                steps.train_loop(iterator, tf.constant(n, tf.int64))
        except tf.errors.OutOfRangeError:
            raise UserError(
                f"the training input ran out of data at step {self.step}: an input_fn must "
                "repeat its data in TRAIN mode (dataset.repeat())"
            ) from None

    # ---------------------------------------------------------------- helpers

    def _evaluate(self, dataset: tf.data.Dataset, steps: int | None, name: str) -> dict:
        compiled = self.model.build(dataset.element_spec, Mode.EVAL)
        self.model.restore_for_inference(self.model_dir)
        if steps is not None:
            dataset = dataset.take(steps)
        compiled.eval_metrics.reset()
        start = time.perf_counter()
        with errors.runtime_errors(f"eval set {name!r}"), self.model.averaged_weights():
            compiled.evaluate(dataset)
        self.seconds["evaluation"] += time.perf_counter() - start
        metrics = compiled.eval_metrics.result()
        if not metrics:
            raise UserError(f"eval set {name!r} is empty: its input_fn yielded no batches")
        self.writers.scalars(f"eval_{name}", self.step, metrics)
        logging.info(
            "eval %s at step %d (%.0f examples, %.1fs): %s",
            name,
            self.step,
            compiled.eval_metrics.count.numpy(),
            time.perf_counter() - start,
            monitoring.format_metrics(metrics),
        )
        return metrics

    def _check_config(self) -> None:
        """Lets ``config_guard`` refuse to resume under a changed configuration."""
        path = os.path.join(self.model_dir, OPERATIVE_CONFIG)
        if self.config_guard is None or self.config_text_fn is None:
            return
        if tf.io.gfile.exists(path):
            with tf.io.gfile.GFile(path) as f:
                self.config_guard(f.read(), self.config_text_fn())

    def _write_config(self, step: int) -> None:
        if self.config_text_fn is None:
            return
        text = self.config_text_fn()
        files.write_atomically(os.path.join(self.model_dir, OPERATIVE_CONFIG), text)
        self.writers.text("train", "operative_config", text, step)


@dataclasses.dataclass
class _Run:
    """One call of ``train``: what its loop works with."""

    input_fn: InputFn
    dataset: tf.data.Dataset
    steps: Steps
    iterator: Any = None
    checkpointer: checkpoints.Checkpointer | None = None
    restored: bool = False
    start: int = 0
    block: int = 1
    input_wait: monitoring.InputWait | None = None
    check_saved_input: bool = False

    @property
    def positioned(self) -> bool:
        """Whether the dataset resumes by arithmetic (its iterator is never saved)."""
        return is_positioned(self.dataset)

    def save(self, step: int) -> None:
        """Checkpoints at ``step``; the first time, warns if the saved input is large."""
        path = self.checkpointer.save(step)
        if self.check_saved_input:
            self.check_saved_input = False
            monitoring.check_input_state(path, self.dataset)
