"""One call of ``Estimator.train``: restore, then compiled blocks with actions between them.

Three levels, as in Keras ``fit -> train_function -> train_step`` and orbit's
controller and runner: ``TrainingRun.run`` (this module) is the Python loop that
decides cadence (log, checkpoint, evaluate, stop); ``step.Steps.train_loop`` runs a
compiled block of steps; one step function touches the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import (
    cadence,
    callbacks,
    checkpoint_writer,
    checkpoints,
    divergence,
    errors,
    logs,
    monitoring,
    settings,
    warm_start,
)
from trainer.distributed import preemption, workers
from trainer.distributed.placement import Placement
from trainer.errors import Preempted, TrainingDiverged, UserError
from trainer.inputs import InputFn, Inputs
from trainer.model_fn import Mode
from trainer.model_state import ModelState
from trainer.step import Steps
from trainer.summaries import Writers
from trainer.training_stream import TrainingStream


@dataclasses.dataclass(frozen=True)
class Loop:
    """The loop's own settings: the Estimator's arguments of the same names."""

    global_batch_size: int
    steps_per_loop: int
    log_every_steps: int
    progress: bool

    def __post_init__(self):
        for name in ("global_batch_size", "steps_per_loop", "log_every_steps"):
            errors.check_count(f"Estimator.{name}", getattr(self, name))


class TrainingRun:
    """Trains one model_dir's model from its newest checkpoint to ``max_steps``.

    Args:
      loop: batch size, steps per compiled block, log period, progress display.
      model: the model, its optimizer and compiled steps (and its ``Optimization``:
        the NaN policy).
      inputs: builds the training input at its position.
      placement: where training runs (and its ``Devices``: XLA, the workers' timeout).
      writers: TensorBoard writers of the model_dir.
      model_dir: where checkpoints go.
      config: the operative config, checked before resuming and written on start.
      policy: which checkpoints are kept, and whether they are written in the background.
      checkpoints, warm_start, summaries: the Estimator's groups of those names.
    """

    def __init__(
        self,
        loop: Loop,
        model: ModelState,
        inputs: Inputs,
        placement: Placement,
        writers: Writers,
        model_dir: str,
        config: checkpoints.ConfigRecord,
        policy: checkpoint_writer.Policy,
        *,
        checkpoints: settings.Checkpoints,
        warm_start: settings.WarmStart,
        summaries: settings.Summaries,
    ):
        self.loop, self.model, self.inputs = loop, model, inputs
        self.placement, self.writers, self.model_dir = placement, writers, model_dir
        self.config, self.policy = config, policy
        self.checkpoints, self.warm_start, self.summaries = checkpoints, warm_start, summaries
        self.stream: TrainingStream | None = None  # the training input, made by _start
        self.config_written = False
        self.events = callbacks.Events(  # none, unless run is given some
            (),
            None,
            epochs_at_logs=False,
            model_dir=model_dir,
            workers=placement.workers,
            chief=True,
        )

    def run(
        self,
        input_fn: InputFn,
        max_steps: int,
        extra: Sequence[cadence.Periodic | cadence.At] = (),
        events: callbacks.Events | None = None,
        ready: Callable[[], object] | None = None,
        epoch_end: Callable[[int], object] | None = None,
    ) -> int:
        """Trains to ``max_steps``; ``extra`` actions run at their steps. Returns the step.

        ``events`` calls the Keras callbacks (``callbacks.Events``); their
        ``on_train_end`` comes before the last checkpoint, which keeps weights they set.
        ``ready`` is called once the model is built and restored, before the first step.
        ``epoch_end(step)`` ends the epoch where training stopped early (a callback set
        ``stop_training``), before ``on_train_end``, as ``fit`` validates there.
        Under multi_worker a watchdog ends the run if every worker stops making progress.
        """
        if events is not None:
            self.events = events
        self.weights_bad = False  # a NaN loss TerminateOnNaN owns left them NaN: not saved
        if self.events.terminate_on_nan and self.model.optimization.nonfinite_loss != "stop":
            raise UserError(
                "keras.callbacks.TerminateOnNaN never sees a NaN loss under "
                "Optimization.nonfinite_loss = 'rollback', which skips its batch: drop one"
            )
        with self.placement.workers.watch(self.placement.settings.progress_timeout), self._held():
            self.stream = TrainingStream(
                self.inputs, self.placement, input_fn, self.checkpoints.input
            )
            start, restored = self._start()
            if ready is not None:
                ready()
            if start >= max_steps:
                logging.info("global_step %d >= max_steps %d: nothing to train.", start, max_steps)
                self.writers.metrics.start()  # evaluations after this are recorded
                return start
            self.stream.start(start)
            self._say_start(start, max_steps, restored)
            log, actions = self._actions(input_fn, start, max_steps, extra)
            self.events.begin(
                start,
                max_steps,
                self.model.model_fn,
                self.model.plan.units,
                self.steps.train_metrics.result,
                log,
                self.model.ema,
                self.steps.epoch_metrics,
            )
            try:
                step = self._loop(start, actions, max_steps, log.progress)
                log(step)  # unless just done: training stopped early
                if step < max_steps and epoch_end is not None:
                    with contextlib.suppress(cadence.StopTraining):  # it has stopped
                        epoch_end(step)
                self.events.end(step)
                if self.weights_bad:  # as fit leaves them; the checkpoints keep whole ones
                    self.model.weights_usable(False)
                else:
                    self.save(step)
                self.checkpointer.wait()  # training returns with its checkpoints whole
            except workers.PEER_ERRORS as error:
                if not self.placement.workers.several:
                    raise
                raise self.placement.workers.lost(
                    error, self.model.step, self.checkpointer.latest
                ) from None
            finally:
                log.progress.close()
                with contextlib.suppress(UserError):  # the error on its way says more
                    self.checkpointer.wait()
                self.checkpointer.close()  # held until exit, it keeps a copy of the weights
            self.input_wait.report()
            return step

    def _actions(self, input_fn, start, max_steps, extra):
        """``(log, actions)``: the log action first, then what runs between blocks.

        The log runs at most once a step (``TrainLog``), and at ``max_steps``; the
        evaluations (``extra``) run before a checkpoint of the same step, so that it
        holds what they changed (a learning rate a callback reduced, say).
        """
        display = None
        if self.loop.progress and self.placement.worker is None:  # the chief shows it
            display = "bar" if sys.stdout.isatty() else "lines"
        log = monitoring.TrainLog(
            self.steps,
            self.writers,
            () if self.model.keras_step else self.model.plan.units,  # its own optimizers
            monitoring.Progress(start, max_steps, self.stream.examples_read, display),
            self.input_wait,
            self.events.log,
        )
        actions = [
            cadence.Periodic(self.loop.log_every_steps, log),
            cadence.At((max_steps,), log),  # before an evaluation there
            # Evaluations before saves: a checkpoint holds what callbacks did at its step.
            *extra,
            cadence.Always(self._stop_if_asked),
            cadence.Periodic(self.checkpoints.every_steps, self.save),
            cadence.Periodic(self.policy.keep_every, self.save),
            *monitoring.tensorboard_actions(
                self.summaries,
                os.path.join(self.placement.workers.write_dir(self.model_dir), "train"),
                self.writers,
                self.steps,
                lambda: next(iter(self.inputs.dataset(input_fn, Mode.EVAL))),
            ),
        ]
        return log, actions

    def save(self, step: int) -> str:
        """Checkpoints at ``step``; returns the path.

        The run's first checkpoint is preceded by its config record (a process killed
        just after the checkpoint must find the record beside it when rerun) and
        followed by its lines of metrics.jsonl and its log: until then, a run that
        fails has changed nothing in model_dir (a record it wrote is taken back when
        the save fails). The first time, it also warns if the saved input is large.
        """
        first = not self.config_written
        new_record = first and self.config.saved() is None
        text = self.config.write() if first else None
        started = time.perf_counter()
        try:
            path = self.checkpointer.save(step)
            if first:  # whole before its record counts, and its input is measured
                self.checkpointer.wait()
        except UserError:
            if new_record:
                self.config.remove()
            raise
        self.model.seconds["checkpoints"] += time.perf_counter() - started
        if first:
            self.config_written = True
            self.writers.metrics.start()
            worker = self.placement.worker
            logs.keep_log(self.model_dir, f"trainer-{worker}.log" if worker else logs.LOG_NAME)
            if text is not None:
                self.writers.text("train", "operative_config", text, step)
        self.stream.saved(path)
        self.events.saved(step, path)
        if self.writers.tracker is not None:  # the metrics up to a checkpoint are final
            self.writers.tracker.commit(step)
        return path

    def _start(self) -> tuple[int, bool]:
        """Data, model and optimizer, restored; returns the step and whether it restored.

        Rerunning the same command continues where it stopped, from the exact next
        batch, unless the configuration changed under the checkpoint. Positioned data
        starts where the checkpoint's input stands (read before restoring, so that the
        dataset is built once).
        """
        chief = self.placement.worker is None
        find = functools.partial(checkpoints.latest_checkpoint, self.model_dir, repair=chief)
        # Several workers look once all are here (the chief's last save is whole by then).
        config = self.config.text_fn or str  # the run's config as text, asked only if compared
        latest = self.placement.workers.check_same_start(find, self.model_dir, config)
        self.placement.workers.heartbeat("starting", checkpoints.step_of(latest) if latest else 0)
        dataset = self.stream.open(latest)
        source = self.warm_start.source
        if latest is None and source:  # opened before building: a wrong path said at once
            source = warm_start.Source(source)
        self.placement.workers.heartbeat("building the model")
        self.steps: Steps = self.model.build(dataset.element_spec, Mode.TRAIN)
        state = {
            **self.model.checkpoint_items(optimizer=True),
            **self.stream.checkpoint_items(latest),
        }
        self.placement.workers.heartbeat("restoring")
        self.checkpointer = checkpoint_writer.Checkpointer(
            self.model_dir,
            self.checkpoints.keep,
            save_dir=self.placement.workers.write_dir(self.model_dir),
            keep_every=self.policy.keep_every,
            protected=self.policy.protected,
            # A saved tf.data iterator is copied by its own serialization, which async
            # checkpointing did not capture exactly (a shuffle buffer resumed apart).
            background=self.policy.background and not self.stream.saves_iterator,
            **state,
        )
        if self.checkpointer.latest is not None:
            variables = self.model.model_fn.trainable_variables
            self.config.check(lambda: checkpoints.misfit(self.checkpointer.latest, variables))
        restored = self.checkpointer.restore_latest() is not None
        if not restored and source:
            warm_start.warm_start(
                self.model.model_fn,
                source,
                self.warm_start.pattern,
                self.warm_start.map,
            )
        self.model.weights_usable()
        self.writers.metrics.resume(self.model.step)
        sized = self.stream.sizes is not None  # examples per batch that vary (sized_by)
        self.block = self.steps.blocks.fit(dataset.element_spec, sized, self.loop.steps_per_loop)
        self.input_wait = monitoring.InputWait(self.steps, self.model.seconds)
        return self.model.step, restored

    def _loop(
        self,
        start: int,
        actions: list,
        max_steps: int,
        progress: monitoring.Progress,
    ) -> int:
        """Compiled blocks of steps, cut where actions are due; returns the step reached."""
        nonfinite = divergence.Divergence(
            self.model.optimization.nonfinite_loss,
            self.model.optimization.max_rollbacks,
            self.checkpointer,
            self.model.global_step,
        )
        step = start
        self.steps.train_metrics.reset()
        with preemption.watch_signals() as signals:
            while step < max_steps:
                if nonfinite.skips(step + 1):
                    self.stream.skip_batch(step + 1)
                limit = min([self.block, max_steps - step, *nonfinite.limits(step)])
                n = cadence.steps_until_due(step, actions, limit)
                self.placement.workers.heartbeat("training", step)
                self.events.block_begin(step)
                with self._block(n):
                    self.steps.train_loop(self.stream.iterator, tf.constant(n, tf.int64))
                resume_at, nan_loss = self._check_finite(nonfinite, step + 1, n)
                if resume_at is not None:  # rolled back, or back to find the bad step
                    step = resume_at
                    self.steps.train_metrics.reset()
                    self.stream.rewind(step)
                    continue
                self.stream.advance(self.model.step - step)
                step = self.model.step
                progress.advance(step)
                self.placement.workers.heartbeat("checkpointing or evaluating", step)
                try:
                    self.events.block_end(step, nan_loss is not None)
                    if nan_loss is not None and not self.events.stopped():
                        self.model.weights_usable(False)  # TerminateOnNaN did not stop it
                        raise nan_loss
                    if cadence.run_due(actions, step):
                        break
                except Exception:
                    self._keep_trained_steps(step)
                    raise
                signalled = self.placement.workers.signalled(
                    signals
                )  # any worker's, under multi_worker
                if signalled:
                    path = self.save(step)
                    self.checkpointer.wait()
                    raise Preempted(
                        f"{signalled}: saved {path} at step {step}; rerun the same "
                        "command to resume"
                    )
        return step

    @contextlib.contextmanager
    def _held(self):
        """An experiment tracker holds the metrics until a checkpoint covers their step.

        Those after the last checkpoint of a run that fails are dropped: a rerun trains
        their steps again, and sends them then.
        """
        tracker = self.writers.tracker
        if tracker is None:
            yield
            return
        tracker.hold(True)
        try:
            yield
        except BaseException:
            tracker.drop()
            raise
        tracker.hold(False)

    def _stop_if_asked(self, step: int) -> None:
        """Stops training (before a save at ``step``) if a callback set ``stop_training``.

        The checkpoint then follows the callbacks' ``on_train_end``, with the weights
        they may put back (EarlyStopping's ``restore_best_weights``).
        """
        if self.events.stopped():
            raise cadence.StopTraining(f"a callback set model.stop_training at step {step}")

    def _say_start(self, start: int, max_steps: int, restored: bool) -> None:
        """The start line: the model, its size, the steps, the devices, the model_dir."""
        parameters = sum(int(np.prod(v.shape)) for v in self.model.model_fn.trainable_variables)
        logging.info(
            "Training %s (%s parameters) from step %d to %d on %s in %s",
            self.model.model_fn,
            f"{parameters:,}",
            start,
            max_steps,
            self.placement.description,
            self.model_dir if restored else f"new {self.model_dir}",
        )

    def _keep_trained_steps(self, step: int) -> None:
        """Checkpoints ``step`` as an action between blocks (an evaluation, say) fails.

        The weights are whole at a block boundary, so what was trained since the last
        checkpoint is kept. Under multi_worker saving takes every worker, and the others
        may not be failing: the run stops at the last checkpoint there.
        """
        if self.placement.workers.several or self.weights_bad:
            return
        try:
            self.save(step)
            self.checkpointer.wait()
        except UserError:  # the failing action was a save, and it failed again
            return

    def _check_finite(
        self, nonfinite: divergence.Divergence, first: int, n: int
    ) -> tuple[int | None, TrainingDiverged | None]:
        """``(Divergence.check, nan_loss)``; the weights in memory marked stale if it diverged.

        The bad step is in them then: evaluate and export restore the checkpoint instead.
        With ``TerminateOnNaN`` given, a NaN or Inf loss is the callback's to act on, as
        in ``fit`` (the epoch ends on the weights the step left); ``nan_loss`` is the
        guard's error, raised if no callback stops training. Nothing saves those weights.
        """
        try:
            return nonfinite.check(self.steps, first, n), None
        except TrainingDiverged as error:
            if self.events.terminate_on_nan and bool(self.steps.nonfinite.numpy()):
                self.weights_bad = True
                return None, error
            self.model.weights_usable(False)
            raise

    @contextlib.contextmanager
    def _block(self, n: int):
        """Around one compiled block of ``n`` steps: its input wait timed, its errors one line.

        The first block of a process also writes the step's graph to TensorBoard.
        """
        graph = contextlib.nullcontext()
        if self.summaries.write_graph and self.model.graph_due():
            graph = monitoring.graph_written(self.writers, self.model.step)
        try:
            with self.input_wait.timing(n), graph:
                with errors.runtime_errors(f"training step {self.model.step + 1}"):
                    yield
        except tf.errors.OutOfRangeError:
            raise UserError(
                f"the training input ran out of data at step {self.model.step}: an input_fn "
                "must repeat its data in TRAIN mode (dataset.repeat())"
            ) from None
