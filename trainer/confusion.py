"""Evaluation you can look at: a classifier's confusion matrix, PR curves, per-class figures.

What is a classifier is found by the trace of EVAL (``classifier``): labels that are
one class id per example (or one-hot rows), and predictions holding ``probabilities``
(``models/heads.py``) or one ``[batch, classes]`` output (a Keras model's; softmaxed
where its rows are not already probabilities). Each eval batch adds to
``ClassCounts``: the confusion matrix, and per class the histogram of its score over
``THRESHOLDS`` buckets among the examples of that class and among the others, from
which every PR curve point follows exactly. They are sums, as ``metrics.MetricSums``
keeps them: exact over batches and towers, and over replicas and workers (kept per
replica, added up when read). An update costs O(batch x classes) whatever
``THRESHOLDS`` is.

``Report`` reads them: per-class precision, recall and support (``--results``), and
for TensorBoard the matrix as an image and a markdown table, and one PR curve per
class (its pr_curve plugin), for up to ``DRAWN_CLASSES`` classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
from absl import logging

from trainer.metrics import replica_sums
from trainer.model_fn import Weighted

THRESHOLDS = 101  # PR curve points: scores 0, 0.01, ..., 1
DRAWN_CLASSES = 32  # beyond this, no table, curves or numbers in the image: one per pixel
# Beyond this, no counts: the matrix grows with classes squared (4,000 classes: 16M cells,
# 128 MB per replica, and a 208 MB --results file).
COUNTED_CLASSES = 1000


@dataclasses.dataclass(frozen=True)
class Classifier:
    """Where a classifier's labels and scores are in its labels and predictions."""

    label: str | None  # its key in the labels dict; None for a bare tensor
    one_hot: bool
    scores: str  # its key in the predictions
    num_classes: int


@tf.autograph.experimental.do_not_convert
def classifier(predictions, labels) -> Classifier | None:
    """How to read the labels and scores of a classifier's batch; None if it is not one.

    ``predictions`` and ``labels`` are a Spec's and the batch's (tensors or specs).
    """
    if isinstance(labels, Weighted):
        labels = labels.labels
    key, label = _only(labels)
    if label is None or not isinstance(predictions, Mapping):
        return None
    scores = "probabilities" if "probabilities" in predictions else None
    if scores is None:
        wide = [k for k, v in predictions.items() if v.shape.rank == 2 and v.dtype.is_floating]
        scores = wide[0] if len(wide) == 1 else None
    if scores is None:
        return None
    num_classes = predictions[scores].shape[-1]
    if num_classes is None or num_classes < 2:
        return None
    if num_classes > COUNTED_CLASSES:
        logging.warning(
            "%d classes: evaluations count no confusion matrix or PR curves (up to %d "
            "classes; they grow with classes squared)",
            num_classes,
            COUNTED_CLASSES,
        )
        return None
    sparse = label.shape.rank == 1 and label.dtype.is_integer
    one_hot = label.shape.rank == 2 and label.shape[-1] == num_classes
    if not (sparse or one_hot):
        return None
    return Classifier(key, one_hot, scores, int(num_classes))


@tf.autograph.experimental.do_not_convert
def _only(labels):
    """``(key, tensor)`` of labels that are one tensor, bare or alone in a dict."""
    if isinstance(labels, Mapping):
        return next(iter(labels.items())) if len(labels) == 1 else (None, None)
    if labels is None or not hasattr(labels, "shape"):
        return None, None
    return None, labels


@tf.autograph.experimental.do_not_convert
def targets_and_scores(found: Classifier, predictions, labels) -> tuple[tf.Tensor, tf.Tensor]:
    """``(targets, probabilities)`` of one batch, both ``[batch, classes]``.

    The targets are the label rows: one-hot for class ids (all zero for an id out of
    range, which the loss says), or multi-hot for a multi-label model's. Scores that
    are neither probabilities (rows summing to 1) nor independent ones (each in
    [0, 1], as sigmoid outputs are) are logits, and softmaxed.
    """
    if isinstance(labels, Weighted):
        labels = labels.labels
    label = labels[found.label] if found.label is not None else labels
    if found.one_hot:
        targets = tf.cast(label, tf.float64)
    else:
        targets = tf.one_hot(tf.cast(label, tf.int32), found.num_classes, dtype=tf.float64)
    given = predictions[found.scores]
    scores = tf.cast(given, tf.float32)
    sums = tf.reduce_sum(scores, axis=-1)
    # A bfloat16 softmax's rows sum to 1 only within its rounding (8 bits of mantissa).
    tolerance = 1e-3 if given.dtype.size >= 4 else 5e-2
    in_range = tf.reduce_all(scores >= 0) & tf.reduce_all(scores <= 1 + tolerance)
    summed = tf.reduce_all(tf.abs(sums - 1) < tolerance)
    multi = tf.reduce_any(tf.reduce_sum(targets, axis=-1) > 1)
    probabilities = in_range & (summed | multi)
    scores = tf.cond(probabilities, lambda: scores, lambda: tf.nn.softmax(scores))
    return targets, scores


class ClassCounts:
    """The confusion matrix and per-class score histograms, summed (see the module)."""

    def __init__(self, num_classes: int, per_replica: bool = False):
        self.num_classes = num_classes
        sync = replica_sums(per_replica)

        def counts(shape, name):
            zeros = tf.zeros(shape, tf.float64)
            return tf.Variable(zeros, trainable=False, name=name, **sync)

        with tf.init_scope():
            self.matrix = counts([num_classes, num_classes], "confusion_matrix")
            self.positives = counts([num_classes, THRESHOLDS], "scores_of_the_class")
            self.negatives = counts([num_classes, THRESHOLDS], "scores_of_the_others")

    @tf.autograph.experimental.do_not_convert
    def update(self, targets: tf.Tensor, scores: tf.Tensor) -> None:
        """Adds one batch: label rows and probabilities, ``[batch, classes]`` each.

        The matrix counts the rows of one class (a multi-label row has no one true
        class); each class's score histograms count every row that has a label.
        """
        classes = self.num_classes
        labelled = tf.cast(tf.reduce_sum(targets, axis=-1) > 0, tf.float64)
        single = tf.cast(tf.abs(tf.reduce_sum(targets, axis=-1) - 1) < 1e-3, tf.float64)
        ids = tf.argmax(targets, axis=-1, output_type=tf.int32)
        predicted = tf.argmax(scores, axis=-1, output_type=tf.int32)
        matrix = tf.math.confusion_matrix(ids, predicted, classes, weights=single, dtype=tf.float64)
        self.matrix.assign_add(matrix)
        bucket = tf.cast(tf.floor(tf.clip_by_value(scores, 0.0, 1.0) * (THRESHOLDS - 1)), tf.int32)
        cell = tf.range(classes)[tf.newaxis, :] * THRESHOLDS + bucket  # [batch, classes]
        others = (1.0 - targets) * labelled[:, tf.newaxis]
        for variable, weight in ((self.positives, targets), (self.negatives, others)):
            summed = tf.math.unsorted_segment_sum(
                tf.reshape(weight, [-1]), tf.reshape(cell, [-1]), classes * THRESHOLDS
            )
            variable.assign_add(tf.reshape(summed, [classes, THRESHOLDS]))

    def reset(self) -> None:
        """Zeroes every count, before an evaluation."""
        for variable in (self.matrix, self.positives, self.negatives):
            variable.assign(tf.zeros_like(variable))

    def report(self) -> Report:
        """What the counts say, read (and added up over replicas and workers)."""
        return Report(
            self.matrix.numpy().round().astype(np.int64),
            self.positives.numpy(),
            self.negatives.numpy(),
        )


class ConfusionMatrix:
    """A classifier's counts as an observer of evaluation (``EvalSteps.observe``).

    The step calls ``update`` with each batch's predictions and labels; evaluation
    calls ``reset`` before and ``written`` after.
    """

    def __init__(self, found: Classifier, per_replica: bool = False):
        self.found, self.counts = found, ClassCounts(found.num_classes, per_replica)

    @tf.autograph.experimental.do_not_convert
    def update(self, predictions, labels) -> None:
        """Adds one eval batch (of a tower's shard, or a replica's part)."""
        self.counts.update(*targets_and_scores(self.found, predictions, labels))

    def reset(self) -> None:
        """Zeroes the counts, before an evaluation."""
        self.counts.reset()

    def written(self, writer: tf.summary.SummaryWriter, step: int) -> dict[str, list]:
        """Writes the counts to TensorBoard at ``step``; returns the per-class figures.

        Reading adds the counts up over replicas and workers: every worker calls it.
        """
        report = self.counts.report()
        write(writer, step, report)
        return report.per_class()


@dataclasses.dataclass
class Report:
    """An evaluation's class counts: ``matrix[true, predicted]`` and score histograms."""

    matrix: np.ndarray
    positives: np.ndarray
    negatives: np.ndarray

    def per_class(self) -> dict[str, list]:
        """Precision, recall and support of each class, and the matrix (``--results``)."""
        hits = np.diag(self.matrix).astype(np.float64)
        predicted, support = self.matrix.sum(axis=0), self.matrix.sum(axis=1)
        return {
            "precision": _ratios(hits, predicted),
            "recall": _ratios(hits, support),
            "support": support.tolist(),
            "confusion_matrix": self.matrix.tolist(),
        }

    def pr_curve(self, label: int) -> np.ndarray:
        """TensorBoard's pr_curve data of one class: ``[6, THRESHOLDS]`` float32.

        Rows: true and false positives, true and false negatives, precision, recall,
        at thresholds ``i / (THRESHOLDS - 1)`` (a score at or above one is positive).
        """
        tp = np.cumsum(self.positives[label][::-1])[::-1]
        fp = np.cumsum(self.negatives[label][::-1])[::-1]
        fn, tn = self.positives[label].sum() - tp, self.negatives[label].sum() - fp
        precision = tp / np.maximum(tp + fp, 1.0)
        recall = tp / np.maximum(tp + fn, 1.0)
        return np.stack([tp, fp, tn, fn, precision, recall]).astype(np.float32)

    def table(self) -> str:
        """The matrix as a markdown table, true classes by row, with recall and precision."""
        classes = range(len(self.matrix))
        figures = self.per_class()
        lines = [
            "| true \\ predicted | " + " | ".join(map(str, classes)) + " | recall |",
            "| --- " * (len(self.matrix) + 2) + "|",
        ]
        for label in classes:
            cells = " | ".join(str(n) for n in self.matrix[label])
            lines.append(f"| **{label}** | {cells} | {_percent(figures['recall'][label])} |")
        precision = " | ".join(_percent(p) for p in figures["precision"])
        return "\n".join([*lines, f"| precision | {precision} | |"])

    def image(self) -> np.ndarray:
        """The matrix drawn: rows true, columns predicted, shaded by each row's share."""
        from PIL import Image, ImageDraw  # Pillow comes with tensorboard

        classes = len(self.matrix)
        rows = np.maximum(self.matrix.sum(axis=1, keepdims=True), 1)
        share = self.matrix / rows
        shade = (255 - share * 200).astype(np.uint8)  # white (none) to deep blue (all)
        pixels = np.stack([shade, shade, np.full_like(shade, 255)], axis=-1)
        if classes > DRAWN_CLASSES:
            return pixels[np.newaxis]
        cell, margin = 28, 24
        size = margin + cell * classes
        picture = Image.new("RGB", (size, size), "white")
        picture.paste(
            Image.fromarray(pixels).resize((cell * classes,) * 2, Image.NEAREST), (margin, margin)
        )
        draw = ImageDraw.Draw(picture)
        draw.text((2, 6), "t\\p", fill="grey")  # true by row, predicted by column
        for i in range(classes):
            draw.text((margin + i * cell + 8, 6), str(i), fill="black")  # predicted
            draw.text((6, margin + i * cell + 8), str(i), fill="black")  # true
            for j in range(classes):
                colour = "white" if share[i, j] > 0.5 else "black"
                where = (margin + j * cell + 3, margin + i * cell + 8)
                draw.text(where, str(self.matrix[i, j]), fill=colour)
        return np.asarray(picture)[np.newaxis]


def _ratios(numerators: np.ndarray, denominators: np.ndarray) -> list[float | None]:
    """Each ratio; None where nothing was counted (no example predicted, or of the class)."""
    return [float(n / d) if d else None for n, d in zip(numerators, denominators, strict=True)]


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def write(writer: tf.summary.SummaryWriter, step: int, report: Report) -> None:
    """The matrix as an image and a table, and each class's PR curve, at ``step``."""
    from tensorboard.plugins.pr_curve import metadata

    with writer.as_default(step=step):
        tf.summary.image("confusion_matrix", report.image())
        if len(report.matrix) > DRAWN_CLASSES:
            return
        tf.summary.text("confusion_matrix/counts", report.table())
        for label in range(len(report.matrix)):
            tag = f"pr_curve/class_{label}"
            described = metadata.create_summary_metadata(tag, "", THRESHOLDS)
            tf.summary.write(tag, report.pr_curve(label), metadata=described.SerializeToString())
    writer.flush()
