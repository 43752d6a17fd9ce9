"""Token-budget batches: each training batch as many examples as fit a budget of positions.

``lengths.token_budget = 4096`` makes a training batch of short examples hold many
and one of long examples few, as fairseq's ``--max-tokens`` does: every batch takes
about the same memory and time, and none is mostly padding. ``global_batch_size``
becomes the most examples a batch may take. Best with ``lengths.buckets`` (one shape
per bucket) and ``lengths.group_batches`` (neighbours in length share a batch).

* **Size.** The batch that starts at stream position ``p`` is padded to a length
  ``b`` and takes ``n(b) = min(global_batch_size, budget // b)`` examples: positions
  ``[p, p + n(b))`` of the training order. ``b`` is the smallest bucket (without
  buckets, the smallest length) that holds the longest of its own ``n(b)`` examples.
  So a batch never passes the budget, and each bucket has one batch size: a compiled
  step compiles at most once per bucket.
* **Position.** The next batch starts at ``p + n(b)``: a batch's size is a function of
  the lengths at the positions from its start, which the order gives from
  ``(seed, position)``. A checkpoint still keeps one position; the Estimator moves it
  after each block by the same arithmetic (``Budget.after``, marked on the dataset
  with ``model_fn.sized_by``), and a resumed run cuts the same batches from there.
  Each example is read once an epoch, as without a budget.
* **Devices.** Replica ``r`` of ``R`` takes positions ``[p + r n // R, p + (r + 1) n
  // R)`` of the batch: shares differ by one example at most, and the step weights each
  replica's loss by its share, so the update is the whole batch's on any number of
  devices and workers.

Cost: sizing a batch reads the order at ``global_batch_size`` positions (with
``group_batches``, one window's sort), in the input pipeline and once more on the
host after each block, a few milliseconds a block of 100 steps; it grows with the
batch and the window, not with the data or the step a run resumes at.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf
from absl import logging

from datasets.lengths import padded_to
from datasets.order import replica_shares
from trainer import InputParams, UserError


class Budget:
    """Where each training batch starts and how many examples it takes.

    Args:
      order: the training order (``Order`` or ``lengths.Grouped``): rows by position.
      lengths: each example's length, by row.
      tokens: the budget, in padded positions per global batch.
      buckets: the lengths batches are padded to (empty: each to its longest).
      most: the most examples a batch takes (``global_batch_size``).
      name: names the source in messages.
    """

    def __init__(self, order, lengths: np.ndarray, tokens: int, buckets, most: int, name: str):
        self.order, self.tokens, self.most = order, int(tokens), int(most)
        longest = int(lengths.max())
        self.candidates = np.asarray(buckets or range(1, longest + 1), np.int64)
        padded = int(self.candidates[np.searchsorted(self.candidates, longest)])
        if padded > self.tokens:
            raise UserError(
                f"lengths.token_budget {self.tokens} cannot hold one example of {name}'s "
                f"longest ({longest}, padded to {padded}): raise it to at least {padded}"
            )
        self.counts = np.minimum(self.most, self.tokens // self.candidates)  # n(b), 0: none
        with tf.init_scope():  # made once, eagerly: datasets and the host's count capture it
            self._lengths = tf.constant(lengths, tf.int64)
            self._candidates = tf.constant(self.candidates)
            self._counts = tf.constant(self.counts)
        self._after = tf.function(self._moved, reduce_retracing=True)
        logging.info(
            "Batching %s by a budget of %s padded positions: %s examples a batch (at most "
            "%s), by the length it is padded to",
            name,
            f"{self.tokens:,}",
            f"{self.tokens // padded:,} to {min(self.most, self.tokens // int(lengths.min())):,}",
            f"{self.most:,}",
        )

    def check_replicas(self, replicas: int, name: str) -> None:
        """Refuses a budget whose longest batch has fewer examples than the replicas."""
        fewest = int(self.counts[self.counts > 0].min())
        if fewest < replicas:
            longest = int(self.candidates[self.counts > 0].max())
            raise UserError(
                f"lengths.token_budget {self.tokens} holds {fewest} of {name}'s longest "
                f"examples (padded to {longest}), fewer than the {replicas} replicas a batch "
                f"feeds: raise it to at least {replicas * longest}"
            )

    @tf.autograph.experimental.do_not_convert
    def cut(self, start: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """The batch at ``start``: its positions, rows (``[n]`` each) and padded length."""
        positions = start + tf.range(self.most, dtype=tf.int64)
        rows = self.order.rows(positions)
        n, length = self._size(tf.gather(self._lengths, rows))
        return positions[:n], rows[:n], length

    def after(self, position: int, steps: int) -> int:
        """The stream position ``steps`` batches on from ``position``."""
        return int(self._after(tf.constant(position, tf.int64), tf.constant(steps, tf.int64)))

    def _moved(self, position: tf.Tensor, steps: tf.Tensor) -> tf.Tensor:
        """``after``, the order read once for every batch it may reach.

        So a grouped window is sorted once, not once a batch.
        """
        reach = position + tf.range((steps + 1) * self.most, dtype=tf.int64)
        ahead = tf.gather(self._lengths, self.order.rows(reach))

        def body(i, offset):
            window = tf.reshape(ahead[offset : offset + self.most], [self.most])
            return i + 1, offset + self._size(window)[0]

        start = (tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        return position + tf.while_loop(lambda i, _: i < steps, body, start)[1]

    def _size(self, ahead: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """``(n(b), b)`` for the lengths ahead: the least ``b`` holding its ``n(b)``."""
        longest_of_first = _running_max(ahead)  # [i]: the longest of the first i + 1
        counts = self._counts
        fits = (counts > 0) & (
            tf.gather(longest_of_first, tf.maximum(counts, 1) - 1) <= self._candidates
        )
        chosen = tf.argmax(tf.cast(fits, tf.int32))
        return tf.gather(counts, chosen), tf.gather(self._candidates, chosen)


def _running_max(x: tf.Tensor) -> tf.Tensor:
    """``[max(x[:1]), max(x[:2]), ...]``, in log2(len) vectorised steps."""
    shift, size = 1, int(x.shape[0])
    while shift < size:
        x = tf.maximum(x, tf.concat([tf.zeros([shift], x.dtype), x[:-shift]], 0))
        shift *= 2
    return x


def stream(
    budget: Budget,
    params: InputParams,
    batch_of: Callable[[tf.Tensor, tf.Tensor], tuple],
) -> tf.data.Dataset:
    """This pipeline's endless batches, from ``params.start_example`` on.

    Each step's batch is cut where the last one ended, then shared out between the
    replicas; this pipeline yields its replicas' shares in turn, each
    ``batch_of(positions, rows)`` with its examples that vary in length padded to the
    step's length.
    """
    replicas, local, first = replica_shares(params)

    def cut(start, _):
        positions, rows, length = budget.cut(start)
        return start + tf.size(positions, out_type=tf.int64), (positions, rows, length)

    def shares(positions, rows, length):
        n = tf.size(positions, out_type=tf.int64)
        bounds = tf.range(first, first + local + 1, dtype=tf.int64) * n // replicas
        limits = bounds[1:] - bounds[0]
        mine = [
            tf.RaggedTensor.from_row_limits(t[bounds[0] : bounds[-1]], limits)
            for t in (positions, rows)
        ]
        return (*mine, tf.fill([local], length))

    def batch(positions, rows, length):
        return tf.nest.map_structure(lambda t: _padded_to(t, length), batch_of(positions, rows))

    steps = tf.data.Dataset.range(np.iinfo(np.int64).max)
    steps = steps.scan(tf.constant(params.start_example, tf.int64), cut)
    return steps.map(shares).unbatch().map(batch, num_parallel_calls=tf.data.AUTOTUNE)


@tf.autograph.experimental.do_not_convert
def _padded_to(t, length: tf.Tensor):
    """A ragged part of a batch padded with zeros to ``length``; any other as it is.

    An example longer than the lengths the batch was sized by (a preprocess that adds
    tokens to records whose lengths were kept before it) fails its batch, never cut.
    """
    if not isinstance(t, tf.RaggedTensor):
        return t
    return padded_to(t, length, LENGTHENED)


LENGTHENED = (
    "an example is longer than its length lengths.token_budget sized its batch by (kept "
    "before preprocess, which lengthened it)"
)
