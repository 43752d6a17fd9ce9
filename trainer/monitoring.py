"""Watching a training run: progress and ETA, input wait, and TensorBoard actions.

The training loop owns none of this; it calls these at the steps they are due:

* ``TrainLog``: the log action: train scalars and a progress line;
* ``Progress``: steps/s, examples/s and an ETA for each log line;
* ``InputWait``: the share of the step time spent waiting for input, and a warning
  naming the knobs when a run is input-bound;
* ``check_input_state``: a warning when a checkpoint's saved input iterator is large;
* actions for ``cadence.Periodic``: weight and activation histograms, labelled eval
  images, the profiler's start and stop, the step's graph written once.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import time
from collections.abc import Callable, Mapping, Sequence

import tensorflow as tf
from absl import logging

from trainer import cadence, checkpoints, console, internals
from trainer.model_fn import Mode, ModelFn, split_element
from trainer.step import Steps
from trainer.summaries import Writers


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``'loss 0.1234  accuracy 0.9'``: metrics as a log line shows them."""
    return "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())


class InputWait:
    """How much of the training time the steps spent waiting for their input.

    The compiled loop adds up the seconds each ``next(iterator)`` blocked
    (``feeding.Feeder.input_seconds``); this divides them by the wall time of the blocks.
    Blocks that traced the step are left out: tracing is not training.
    """

    # A run is input-bound when its steps wait this share of the time, and longer
    # than taking a ready batch from the pipeline costs anyway. That handoff is
    # what no pipeline change removes: tens of microseconds on an idle machine, and
    # 0.3-1.3 ms per step on this 2-core one with the prefetch threads competing
    # (digits in memory, cached and prefetched: 20-25% of a toy model's step). A
    # pipeline that decodes or reads too slowly waits far longer: milliseconds per
    # step on small images, hundreds on ImageNet's.
    INPUT_BOUND = 0.2
    MIN_WAIT_PER_STEP = 2e-3

    def __init__(self, steps: Steps, seconds: collections.Counter):
        self.steps = steps
        self.seconds = seconds  # the Estimator's: where its time went
        self.wait = self.time = 0.0
        self.steps_timed = 0
        self._at_last_log = (0.0, 0.0)

    @contextlib.contextmanager
    def timing(self, num_steps: int):
        """Times one block of ``num_steps`` steps run inside the context."""
        traces = self.steps.blocks.traces()
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        wait = float(self.steps.feeder.input_seconds.numpy())
        self.steps.feeder.input_seconds.assign(0.0)
        if self.steps.blocks.traces() == traces:
            self.wait, self.time = self.wait + wait, self.time + seconds
            self.steps_timed += num_steps
            self.seconds["training"] += seconds
        else:
            self.seconds["tracing_block"] += seconds

    def since_last_log(self) -> dict[str, float]:
        """``{'input_wait_share': share}`` since the previous call (empty if unknown)."""
        wait, seconds = self.wait - self._at_last_log[0], self.time - self._at_last_log[1]
        self._at_last_log = (self.wait, self.time)
        if seconds <= 0 or not self.steps.feeder.times_input:
            return {}
        return {"input_wait_share": min(wait / seconds, 1.0)}

    def report(self) -> None:
        """One line at the end of training; a warning, naming the knobs, if input-bound."""
        if not self.steps.feeder.times_input:
            logging.info("Input wait is not measured under op determinism (no tf.timestamp)")
            return
        if self.time <= 0:
            return
        share = min(self.wait / self.time, 1.0)
        if share < self.INPUT_BOUND or self.wait < self.MIN_WAIT_PER_STEP * self.steps_timed:
            logging.info("Input: the steps waited for data %.0f%% of the time", 100 * share)
            return
        logging.warning(
            "Training is input-bound: the steps waited for data %.0f%% of the time; cache "
            "the decoded examples (pipeline.cache), map with num_parallel_calls="
            "tf.data.AUTOTUNE, prefetch, or prepare TFRecords of preprocessed examples",
            100 * share,
        )


class TrainLog:
    """The log action: train scalars to TensorBoard, a progress line, then the callbacks.

    The scalars are the log period's means, and each streamed metric's value in the
    epoch so far (``metrics.EpochMetrics``: the period's own when epochs are log
    periods, as under ``train``).

    Args:
      steps: the compiled steps, whose train metrics are read and reset.
      writers: TensorBoard writers.
      units: the optimizers whose learning rates are logged (``optimizer_groups.Unit``).
      progress: rates and ETA.
      input_wait: the input-wait share since the last log.
      logged: ``logged(step, logs)`` after each log (the callbacks' ``Events.log``).

    The gradient norm logged is the block's last step's.
    """

    def __init__(
        self,
        steps: Steps,
        writers: Writers,
        units: Sequence,
        progress: Progress,
        input_wait: InputWait,
        logged: Callable[[int, dict], None],
    ):
        self.steps, self.writers, self.units = steps, writers, units
        self.progress, self.input_wait, self.logged = progress, input_wait, logged
        self.last_step: int | None = None

    def __call__(self, step: int) -> None:
        """Logs the metrics since the previous log."""
        if step == self.last_step:  # an epoch's end logged it already
            return
        self.last_step = step
        counting = self.steps.train_accounting
        logs = counting.derived(self.steps.train_metrics.result())
        self.steps.train_metrics.reset()
        # Streamed metrics (AUC, F1) as they stand in the epoch, as Keras's batch logs
        # and TensorBoard have them; the epoch's end reads and resets them.
        logs.update(self.steps.epoch_metrics.result())
        if not self.steps.keras_step:  # a Keras model's own step keeps its gradients
            logs["gradient_norm"] = float(self.steps.gradient_norm.numpy())
        logs.update(self.progress.rates(step))
        logs = counting.rates(logs)  # the padding share and tokens/s of counted tokens
        logs.update(self.input_wait.since_last_log())
        for unit in self.units:  # learning_rate, or learning_rate/generator, ...
            name = "learning_rate" if unit.name == "model" else f"learning_rate/{unit.name}"
            logs[name] = float(tf.convert_to_tensor(unit.optimizer.learning_rate))
        self.writers.scalars("train", step, logs)
        self.progress.show(step, logs)
        self.logged(step, logs)


class Progress:
    """Steps/s, examples/s and an ETA from the wall time between log steps, shown.

    Args:
      start: the step training starts from.
      max_steps: the step it stops at.
      examples_read: how many examples of the training stream are read so far (its
        position: batches sized by a token budget vary in examples).
      display: ``'bar'`` (a live bar, moved every block), ``'lines'`` (a line on
        stdout every log step) or None; the line always goes to the log as well.
    """

    def __init__(
        self,
        start: int,
        max_steps: int,
        examples_read: Callable[[], int],
        display: str | None = None,
    ):
        self.max_steps = max_steps
        self.examples_read = examples_read
        self.last_step, self.last_time = start, time.perf_counter()
        self.last_examples = examples_read()
        self.display = display
        self.bar = console.ProgressBar(start, max_steps, "train") if display == "bar" else None

    def advance(self, step: int) -> None:
        """A block ended at ``step``: the bar moves (no device sync: the loop knows it)."""
        if self.bar is not None:
            self.bar.update(step)

    def show(self, step: int, logs: Mapping[str, float]) -> None:
        """The log step's line: to the log, and to the bar or stdout."""
        line = self.line(step, logs)
        logging.info("%s", line, extra={"console": False})  # the console shows it below
        if self.bar is not None:
            model_metrics = {
                k: v for k, v in _shown(logs).items() if k.split("/")[0] not in AUXILIARY
            }
            self.bar.update(step, format_metrics(model_metrics))
        elif self.display == "lines":
            print(line, flush=True)

    def close(self) -> None:
        """The run ended: the bar stays on screen at its last step."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def rates(self, step: int) -> dict[str, float]:
        """Steps/s and examples/s since the previous call."""
        now, examples = time.perf_counter(), self.examples_read()
        seconds = max(now - self.last_time, 1e-9)
        rates = {
            "steps_per_sec": (step - self.last_step) / seconds,
            "examples_per_sec": (examples - self.last_examples) / seconds,
        }
        self.last_step, self.last_time, self.last_examples = step, now, examples
        return rates

    def line(self, step: int, logs: Mapping[str, float]) -> str:
        """The log line of ``step``: its metrics, examples/s and the ETA."""
        rate = logs["steps_per_sec"]
        # No progress since the last line (a rollback to it) has no ETA.
        eta = datetime.timedelta(seconds=round((self.max_steps - step) / rate)) if rate > 0 else "-"
        return (
            f"step {step}/{self.max_steps}  {format_metrics(_shown(logs))}  "
            f"{logs['examples_per_sec']:.0f} examples/s  ETA {eta}"
        )


# What a log line shows besides the model's loss and metrics (the bar leaves them out).
AUXILIARY = ("gradient_norm", "input_wait_share", "learning_rate")


def _shown(logs: Mapping[str, float]) -> dict[str, float]:
    """The metrics a progress line shows (the rates are shown apart)."""
    return {k: v for k, v in logs.items() if k not in ("steps_per_sec", "examples_per_sec")}


# A saved input iterator is warned of above this, or above a megabyte when it is larger
# than the rest of the checkpoint (a 13k-parameter model saving a 7.5 MB shuffle buffer).
INPUT_STATE_WARN_BYTES = 64 * 2**20


def check_input_state(path: str, dataset: tf.data.Dataset) -> None:
    """Warns when a checkpoint's saved input iterator is large, naming what holds it."""
    numeric = checkpoints.numeric_bytes(tf.train.load_checkpoint(path))
    stored = sum(tf.io.gfile.stat(f).length for f in tf.io.gfile.glob(path + ".data-*"))
    size = stored - numeric  # the iterator is the one large string the checkpoint holds
    if size <= INPUT_STATE_WARN_BYTES and (size <= 2**20 or size <= numeric):
        return
    holders = sorted(buffering_stages(dataset)) or ["buffers of its transformations"]
    logging.warning(
        "The training input's saved state is %.0f MB in each checkpoint (%s), held by its "
        "%s: read the data by index (datasets.pipeline.build over an ArraySource, or "
        "TFRecord shards) so that a checkpoint holds only its position, or set "
        "Checkpoints.input = False",
        size / 2**20,
        os.path.basename(path),
        " and ".join(holders),
    )


def buffering_stages(dataset: tf.data.Dataset) -> set[str]:
    """The stages of a pipeline whose contents a saved iterator holds (shuffle, cache)."""
    found, stack = set(), [dataset]
    while stack:
        stage = stack.pop()
        kind = type(stage).__name__
        if "Shuffle" in kind:
            found.add("shuffle buffer (Dataset.shuffle)")
        elif "Cache" in kind:
            found.add("cache (Dataset.cache)")
        stack.extend(internals.dataset_inputs(stage))  # [] for what is not a stage
    return found


def profiler_actions(profile_steps: tuple[int, int] | None, logdir: str) -> list[cadence.At]:
    """Start and stop the profiler at the two ``profile_steps`` (block boundaries)."""
    if not profile_steps:
        return []
    start, stop = profile_steps
    return [
        cadence.At((start,), lambda step: tf.profiler.experimental.start(logdir)),
        cadence.At((stop,), lambda step: tf.profiler.experimental.stop()),
    ]


@contextlib.contextmanager
def graph_written(writers: Writers, step: int):
    """Writes the graph of the functions traced inside the context to TensorBoard.

    Only when the context ends well: a block that fails writes nothing.
    """
    tf.summary.trace_on(graph=True)
    try:
        yield
    except BaseException:
        tf.summary.trace_off()
        raise
    with writers.get("train").as_default(step=step):
        tf.summary.trace_export("train_step", step=step)


def histogram_action(writers: Writers, model_fn: ModelFn, features) -> Callable[[int], None]:
    """Writes every weight, and the activations the Spec reports on ``features``."""
    activations = tf.function(lambda f: dict(model_fn(f, None, Mode.PREDICT).activations))

    def write(step: int) -> None:
        writers.histograms("train", step, model_fn.trainable_variables)
        outputs = activations(features)
        writers.histograms(
            "train", step, [_Named(f"activations/{k}", v) for k, v in outputs.items()]
        )

    return write


def image_action(writers: Writers, steps: Steps, features, labels) -> Callable[[int], None]:
    """Writes predicted images (a GAN's) and a classifier's labelled input images.

    A classifier's batch images are labelled with predicted and true classes.
    """

    def write(step: int) -> None:
        predictions = steps.eval.predict(features)
        for name, value in predictions.items():
            if value.shape.rank == 4 and value.shape[-1] in (1, 3) and value.dtype.is_floating:
                writers.images("train", step, f"predicted/{name}", value.numpy())
        predicted = predictions.get("classes")
        if predicted is None or "image" not in features or features["image"].shape.rank != 4:
            return
        writers.labelled_images(
            "train", step, features["image"].numpy(), predicted.numpy(), labels["label"].numpy()
        )

    return write


class _Named:
    """A tensor with a ``path``, so that activations and weights share one writer."""

    def __init__(self, path: str, value: tf.Tensor):
        self.path, self.value = path, value


def tensorboard_actions(
    every, train_dir: str, writers: Writers, steps: Steps, eval_batch: Callable[[], tuple]
) -> list[cadence.Periodic | cadence.At]:
    """Histograms, labelled images and the profiler, at the steps ``every`` asks for.

    ``every`` is the Estimator's ``Summaries``: ``profile_steps``, ``histogram_every_steps``
    and ``image_every_steps``; ``eval_batch`` gives the one batch the images are drawn from.
    """
    actions = profiler_actions(every.profile_steps, train_dir)
    if every.histogram_every_steps or every.image_every_steps:
        features, labels = split_element(eval_batch(), Mode.EVAL)
    if every.histogram_every_steps:
        write = histogram_action(writers, steps.model_fn, features)
        actions.append(cadence.Periodic(every.histogram_every_steps, write))
    if every.image_every_steps:
        write = image_action(writers, steps, features, labels)
        actions.append(cadence.Periodic(every.image_every_steps, write))
    return actions
