"""Judging what a language model generates from held-out prompts, as an eval metric.

A fine-tuned model is read by what it writes, not only by its loss: the share of its
answers that a program accepts. ``LanguageModel.judge`` names a ``Judge``; in EVAL,
on chats whose labels carry the assistant's mask (``chat.input_fn``), the model
continues each chat's prompt (its tokens before the first answer, ``prompts``),
greedily, and reports the judge's mean score as a metric of the eval set, streamed
over all of it as any metric is: the same number padded or packed, on one device or
many, and in ``--results`` beside the loss.

* ``PythonParses``: 1 when the answer, up to the template's end marker, is Python that
  ``ast.parse`` accepts, holding a statement (not blank, not comments alone); its
  metric is ``parse_share``.

Cost: ``LanguageModel.generate`` steps of the model on the eval set's chats, at each
evaluation, besides the loss's one pass.
"""

from __future__ import annotations

import ast

import gin
import numpy as np
import tensorflow as tf


class Judge:
    """Scores generated texts: ``score(texts)``, ``[n]`` UTF-8 bytes to ``[n]`` float32.

    Attributes:
      name: the metric its mean is reported as.
    """

    name = "judged_share"

    def score(self, texts: np.ndarray) -> np.ndarray:
        """Each text's score, 0 to 1."""
        raise NotImplementedError

    @tf.autograph.experimental.do_not_convert
    def scores(self, texts: tf.Tensor) -> tf.Tensor:
        """``score`` of a ``[n]`` string tensor, in the graph."""
        found = tf.numpy_function(self.score, [texts], tf.float32, stateful=False)
        found.set_shape(texts.shape)
        return found


@gin.configurable
class PythonParses(Judge):
    """1 for an answer that is Python ``ast.parse`` accepts with a statement: ``parse_share``.

    Args:
      stop: where an answer ends, if before the text's end: the chat template's end
        marker (ChatML's ``<|im_end|>``).
    """

    name = "parse_share"

    def __init__(self, stop: str = "<|im_end|>"):
        self.stop = stop

    def score(self, texts: np.ndarray) -> np.ndarray:
        """Each text's 1 or 0."""
        return np.asarray([self.parses(t) for t in texts.reshape(-1)], np.float32)

    def parses(self, text: bytes) -> bool:
        """Whether the answer in ``text`` (up to ``stop``) is Python of one statement or more.

        A blank answer, or comments alone, which ``ast.parse`` accepts too, is not.
        """
        answer = text.decode("utf-8", "replace")
        answer = answer.split(self.stop, 1)[0] if self.stop else answer
        try:
            return bool(ast.parse(answer).body)
        except (SyntaxError, ValueError):  # ValueError: a null byte
            return False


@tf.autograph.experimental.do_not_convert
def prompts(tokens: tf.Tensor, segments: tf.Tensor, mask: tf.Tensor):
    """Each example's prompt in a batch of rows (padded, or packed with ``segments``).

    ``tokens``, ``segments`` and ``mask`` (the assistant's targets) are ``[rows, n]``.
    An example's prompt is its tokens up to the one whose next is its first answer
    token (all of them if none is). Returns ``(prompts, rows)``: a ragged ``[examples,
    None]`` of ids, and the row each example lies in, ``[examples]``.
    """
    real = tf.not_equal(segments, 0)
    width = tf.cast(tf.shape(tokens)[1], tf.int64)
    place = tf.where(real)  # [tokens, 2]: (row, column), row-major
    keys = place[:, 0] * (width + 1) + tf.cast(tf.boolean_mask(segments, real), tf.int64)
    starts = tf.concat([[True], tf.not_equal(keys[1:], keys[:-1])], 0)[: tf.shape(keys)[0]]
    example = tf.cumsum(tf.cast(starts, tf.int64)) - 1
    count = tf.reduce_sum(tf.cast(starts, tf.int64))
    within = tf.range(tf.shape(example, out_type=tf.int64)[0]) - tf.gather(
        tf.math.unsorted_segment_min(tf.range(tf.size(example, tf.int64)), example, count),
        example,
    )
    marked = tf.not_equal(tf.boolean_mask(mask, real), 0)
    late = tf.where(marked, within, tf.int64.max)
    first = tf.math.unsorted_segment_min(late, example, count)  # int64.max: no answer
    keep = within <= tf.gather(first, example)
    kept = tf.RaggedTensor.from_value_rowids(
        tf.boolean_mask(tf.boolean_mask(tokens, real), keep),
        tf.boolean_mask(example, keep),
        nrows=count,
    )
    rows = tf.math.unsorted_segment_min(place[:, 0], example, count)
    return kept, rows


@tf.autograph.experimental.do_not_convert
def per_row(scores: tf.Tensor, rows: tf.Tensor, count: tf.Tensor):
    """Examples' ``scores`` as a Spec metric of ``count`` rows: each row's mean and examples."""
    sums = tf.math.unsorted_segment_sum(scores, rows, count)
    examples = tf.math.unsorted_segment_sum(tf.ones_like(scores), rows, count)
    return tf.math.divide_no_nan(sums, examples), examples
