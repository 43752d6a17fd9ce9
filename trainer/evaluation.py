"""Evaluation around training: eval sets, best exports, early stopping, side-car polling.

The Estimator evaluates one eval set at a time (``Estimator.evaluate``); this module
decides which, when, and what follows from the metrics:

* ``eval_sets``: one input_fn or a dict of them, as a dict keyed by eval-set name;
* ``Evaluations``: the action ``train_and_evaluate`` runs at its evaluation steps:
  every eval set, then the best export and early stopping on the first one;
* ``continuous`` and ``new_checkpoints``: each checkpoint a training job writes,
  evaluated once by an evaluator running beside it (``Estimator.continuous_evaluate``);
* ``predictions``: the model's outputs, one dict per example (``Estimator.predict``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import tensorflow as tf
from absl import logging

from trainer import (
    cadence,
    checkpoint_writer,
    checkpoints,
    console,
    errors,
    export,
    monitoring,
    whole_files,
)
from trainer.errors import UserError
from trainer.model_fn import Mode, num_examples, split_element
from trainer.model_state import ModelState
from trainer.summaries import Writers

PROGRESS_FILE = "continuous_eval.json"  # the last step a side-car evaluator finished

Metrics = dict[str, float]


def best_exporter(
    model_dir: str, metric: str | None, keep: int, higher: bool
) -> export.BestExporter | None:
    """Exports to ``model_dir/export/best`` when ``metric`` ranks among the best (None: off)."""
    if not metric:
        return None
    return export.BestExporter(os.path.join(model_dir, "export", "best"), metric, keep, higher)


def early_stopping(metric: str | None, patience: int, higher: bool) -> cadence.Patience | None:
    """Stops training once ``metric`` has not improved for ``patience`` evaluations."""
    return cadence.Patience(metric, patience, higher) if metric else None


def eval_sets(eval_input_fns: Callable | Mapping[str, Callable]) -> dict[str, Callable]:
    """``{name: input_fn}``; a single input_fn is the eval set named ``eval``."""
    if isinstance(eval_input_fns, Mapping):
        return dict(eval_input_fns)
    return {"eval": eval_input_fns}


class Evaluations:
    """Evaluates every eval set; exports the best; stops training when it stopped improving.

    Args:
      evaluate: ``evaluate(name) -> metrics`` of one eval set at the current weights.
      names: the eval sets, in order; the first one ranks exports and early stopping.
      best_exporter: exports when the first set's metric ranks among the best, or None.
      export_model: ``export_model(path)`` writes a SavedModel there.
      early_stopping: when the first set's metric stopped improving, or None.
      exported: called after a best export (the checkpoints kept may change).
      evaluated: ``evaluated(step, results)`` after every eval set, before the best
        export and early stopping (the callbacks' ``Events.epoch_end``).
    """

    def __init__(
        self,
        evaluate: Callable[[str], Metrics],
        names: list[str],
        best_exporter: export.BestExporter | None,
        export_model: Callable[[str], str],
        early_stopping: cadence.Patience | None,
        exported: Callable[[], None] = lambda: None,
        evaluated: Callable[[int, dict], None] = lambda step, results: None,
    ):
        self.evaluate, self.names, self.exported = evaluate, names, exported
        self.evaluated = evaluated
        self.best_exporter, self.export_model = best_exporter, export_model
        self.early_stopping = early_stopping
        self.results: dict[str, Metrics] = {}
        self.evaluated_at: list[int] = []

    def __call__(self, step: int) -> None:
        """Evaluates at ``step``; raises ``cadence.StopTraining`` to stop early."""
        if step in self.evaluated_at[-1:]:  # due twice at the last step
            return
        for name in self.names:
            self.results[name] = self.evaluate(name)
        self.evaluated_at.append(step)
        self.evaluated(step, self.results)
        first = self.results[self.names[0]]
        if self.best_exporter is not None:
            if self.best_exporter.maybe_export(step, first, self.export_model):
                self.exported()
        if self.early_stopping is not None and self.early_stopping.should_stop(first, step):
            raise cadence.StopTraining(
                f"early stopping at step {step}: {self.early_stopping.metric} has not "
                f"improved for {self.early_stopping.patience} evaluations"
            )

    def replay(self, records: list[dict]) -> None:
        """A resumed run's early stopping: the first set's evaluations before it, again.

        ``records`` are its lines of metrics.jsonl up to the checkpoint resumed from, so
        patience counts on where the straight run would be.
        """
        if self.early_stopping is None:
            return
        for record in records:
            metrics = {k: v for k, v in record.items() if k not in ("step", "time", "writer")}
            if self.early_stopping.metric in metrics:
                self.early_stopping.should_stop(metrics, record["step"])

    def final(self, step: int) -> dict[str, Metrics]:
        """The results after training ends at ``step``, evaluating unless just done."""
        if step not in self.evaluated_at:
            try:
                self(step)
            except cadence.StopTraining:  # training is over anyway
                pass
        return self.results


def evaluate(
    model: ModelState,
    dataset: tf.data.Dataset,
    steps: int | None,
    name: str,
    writers: Writers,
    model_dir: str,
    bar: bool = False,
    batch_size: int | None = None,
) -> Metrics:
    """Evaluates eval set ``name`` (its first ``steps`` batches if given); logs the metrics.

    The steps' observers of evaluation write what they counted too: a classifier's
    confusion matrix and PR curves to TensorBoard, its per-class precision, recall and
    matrix to ``model.classes[name]`` (``trainer.confusion``).

    Uses the weights in memory when they are trained, else the newest checkpoint in
    ``model_dir``; writes the metrics to ``model_dir/eval_<name>``. With ``bar``, a
    progress bar shows on a terminal (moved from beside the one compiled call; its
    total estimated from the batches and ``batch_size``).
    """
    compiled = model.for_inference(dataset.element_spec, Mode.EVAL, model_dir)
    watched = contextlib.nullcontext()
    placement = model.placement
    if bar and sys.stdout.isatty() and not placement.workers.several:  # counted as they come
        # (under multi_worker reading the count is a collective: not from a thread)
        count = compiled.eval.metrics.count.numpy
        total = _examples(dataset, steps, batch_size)
        watched = console.Watched(count, total, f"eval {name!r}", " examples")
    if steps is not None:
        dataset = dataset.take(steps)
    compiled.eval.metrics.reset()
    for observer in compiled.eval.observers:
        observer.reset()
    start = time.perf_counter()
    with errors.runtime_errors(f"eval set {name!r}"), model.averaged_weights(), watched:
        compiled.eval.evaluate(placement.eval_input(dataset))
    model.seconds["evaluation"] += time.perf_counter() - start
    metrics = compiled.eval.accounting.derived(compiled.eval.metrics.result())
    if not metrics:
        raise UserError(f"eval set {name!r} is empty: its input_fn yielded no batches")
    writers.scalars(f"eval_{name}", model.step, metrics)
    for observer in compiled.eval.observers:  # read on every worker: the read adds them up
        model.record_classes(name, observer.written(writers.get(f"eval_{name}"), model.step))
    logging.info(
        "Evaluation of %r at step %d (%.0f examples, %.1fs): %s",
        name,
        model.step,
        compiled.eval.metrics.count.numpy(),
        time.perf_counter() - start,
        monitoring.format_metrics(metrics),
    )
    return metrics


def _examples(dataset: tf.data.Dataset, steps: int | None, batch_size: int | None) -> int | None:
    """How many examples an evaluation reads: exact if the dataset is ``counted``, else at most."""
    exact = num_examples(dataset)
    batches = int(dataset.cardinality())
    if steps is not None:
        batches = steps if batches < 0 else min(batches, steps)
    at_most = batches * batch_size if batches >= 0 and batch_size else None
    if exact is not None and at_most is not None:
        return min(exact, at_most)
    return exact if steps is None else at_most


def predictions(model: ModelState, dataset: tf.data.Dataset, steps) -> Iterator[dict[str, Any]]:
    """One dict of numpy predictions per example of ``dataset``, as the batches come."""
    for element in errors.guarded(dataset, "predict input"):
        features, _ = split_element(element, Mode.PREDICT)
        with errors.runtime_errors("predict"), model.averaged_weights():
            batch = {k: v.numpy() for k, v in steps.eval.predict(features).items()}
        for i in range(len(next(iter(batch.values())))):
            yield {k: v[i] for k, v in batch.items()}


def continuous(
    model: ModelState,
    model_dir: str,
    eval_sets: Mapping[str, tf.data.Dataset],
    evaluate: Callable[[tf.data.Dataset, str], Metrics],
    new: Iterator[str],
) -> dict[str, Metrics]:
    """Restores each checkpoint ``new`` hands out and evaluates every eval set on it.

    A checkpoint deleted before its turn is skipped with a warning. Returns the
    metrics of the last evaluation, keyed by eval-set name.
    """
    model.build(next(iter(eval_sets.values())).element_spec, Mode.EVAL)
    checkpointer = checkpoint_writer.Checkpointer(
        model_dir, **model.checkpoint_items(optimizer=False)
    )
    results: dict[str, Metrics] = {}
    for path in new:
        try:
            checkpointer.checkpoint.restore(path).expect_partial()
        except (tf.errors.NotFoundError, ValueError):
            logging.warning("Checkpoint %s was deleted before evaluation: skipped", path)
            continue
        model.weights_usable()
        results = {name: evaluate(dataset, name) for name, dataset in eval_sets.items()}
    return results


def _evaluated_step(path: str) -> int:
    """The last step the side-car finished, from its record (-1: none, or unreadable)."""
    try:
        record = whole_files.read_json(path, {})
        step = record.get("step", -1) if isinstance(record, dict) else None
        if not isinstance(step, int):
            raise whole_files.Unreadable(path, ValueError(f"no step in {record!r:.40}"))
    except whole_files.Unreadable as error:
        logging.warning("%s; evaluating every checkpoint again", error)
        return -1
    return step


def new_checkpoints(
    model_dir: str, max_steps: int, poll_seconds: float, timeout_seconds: float | None
) -> Iterator[str]:
    """Each checkpoint a training job writes to ``model_dir``, oldest first, once.

    Stops after one at or past ``max_steps``. The last step handed out is kept in
    ``model_dir/continuous_eval.json`` once the caller asks for the next, so a
    restarted evaluator goes on where it stopped.

    Raises:
      UserError: no new checkpoint came for ``timeout_seconds``.
    """
    progress_path = os.path.join(model_dir, PROGRESS_FILE)
    done = _evaluated_step(progress_path)
    waited = 0.0
    while done < max_steps:
        pending = [
            p for p in checkpoints.all_checkpoints(model_dir) if checkpoints.step_of(p) > done
        ]
        if not pending:
            if timeout_seconds is not None and waited >= timeout_seconds:
                raise UserError(
                    f"no new checkpoint in {model_dir} for {timeout_seconds:.0f}s after "
                    f"step {done}; is training running?"
                )
            time.sleep(poll_seconds)
            waited += poll_seconds
            continue
        waited = 0.0
        for path in pending:
            yield path
            done = checkpoints.step_of(path)
            whole_files.write_json(progress_path, {"step": done})
