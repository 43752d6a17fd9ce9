"""Examples that vary in length, batched by length: an order that groups them, and buckets.

A batch of sequences is padded to its longest example, so a batch drawn at random
from lengths 4 to 320 is mostly padding. Two knobs, bound in gin under ``lengths``,
cut it. Both act on sources read by index whose examples vary in length: in memory
(``ArraySource``, an example's length its longest ``tf.RaggedTensor`` part), or
records on disk whose lengths were kept beside them (``RecordExamples.lengths``,
which ``prepare --text`` writes: 4 bytes an example, the records never read to sort):

* ``lengths.group_batches = 50``: the training order groups examples of similar
  length. The stream (``datasets/order.py``) is cut into windows of 50 global
  batches, and each window is sorted by length, longest first, so a batch holds
  neighbours in length. A window that spans the end of an epoch sorts each epoch's
  part apart, so every example is still read once an epoch. A window is sorted again
  from ``(seed, position)`` whenever a batch of it is read: the order keeps no state,
  and a resumed run starts at its exact next batch in constant time.
* ``lengths.buckets = [32, 64, 128, 256, 320]``: each batch is padded to the
  smallest bucket that holds its longest example instead of to that example: a few
  shapes, so a compiled step compiles once per bucket. An example longer than the
  last bucket is refused before training, counted: never cut silently (on disk, the
  records whose kept length passes it are read through preprocess first).

Cost: reading a batch sorts its window, ``O(W log W)`` for a window of ``W``
examples (50 batches of 64: 3,200), on the input threads; it grows with the window,
not with the data's size or the step a run resumes at.

A third knob, ``lengths.token_budget``, sizes the training batches themselves by these
lengths: ``datasets/token_budget.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import gin
import numpy as np
import tensorflow as tf
from absl import logging

from datasets.order import Order
from datasets.sources import ArraySource, RecordExamples
from trainer import UserError, errors

PROBED = 4096  # records on disk read before training to check their length (at most)


@dataclasses.dataclass(frozen=True)
class Lengths:
    """How examples that vary in length are ordered and padded (``lengths.options``)."""

    group_batches: int = 0
    buckets: tuple[int, ...] = ()
    token_budget: int = 0

    @property
    def active(self) -> bool:
        """Whether any knob is bound."""
        return bool(self.group_batches or self.buckets or self.token_budget)


@gin.configurable("lengths")
def options(group_batches: int = 0, buckets: Sequence[int] = (), token_budget: int = 0) -> Lengths:
    """The knobs, as bound in gin (``lengths.buckets = [64, 128, 256]``).

    Args:
      group_batches: windows of this many global batches of the training order are
        sorted by length, longest first; 0 keeps the order random.
      buckets: increasing lengths; a batch is padded to the smallest that holds its
        longest example. Empty: to that example.
      token_budget: each training batch takes as many examples as fit this many
        padded positions, at most ``global_batch_size`` (``datasets/token_budget.py``);
        0: ``global_batch_size`` each.
    """
    return Lengths(group_batches, tuple(buckets), token_budget)


@gin.configurable("lengths.geometric")
def geometric(shortest: int = 8, longest: int = 512, ratio: float = 1.15, multiple: int = 4):
    """Bucket lengths from ``shortest`` to ``longest``, each ``ratio`` times the last.

    A batch padded to one then wastes at most about ``ratio - 1`` of it on padding
    (0.15: 25 buckets from 8 to 320). Each length is rounded up to a ``multiple``,
    and ``longest`` is the last. In gin: ``lengths.buckets = @lengths.geometric()``.
    """
    errors.check_count("lengths.geometric.shortest", shortest)
    errors.check_count("lengths.geometric.longest", longest, minimum=shortest)
    errors.check_count("lengths.geometric.multiple", multiple)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not ratio > 1:
        raise UserError(
            f"lengths.geometric.ratio must be a number > 1 (each length that times the last), "
            f"got {ratio!r}"
        )
    found, length = [], float(shortest)
    while length < longest:
        rounded = int(-(-length // multiple) * multiple)
        if not found or rounded > found[-1]:
            found.append(rounded)
        length *= ratio
    return [b for b in found if b < longest] + [int(longest)]


def knobs() -> Lengths:
    """The bound knobs, checked here, outside gin's call, so a refusal is its one line."""
    group_batches, buckets, token_budget = dataclasses.astuple(options())
    for name, value, unit in (
        ("group_batches", group_batches, "batches"),
        ("token_budget", token_budget, "positions"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"lengths.{name} must be a whole number of {unit} >= 0, got {value!r}")
    whole = all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets)
    if not whole or list(buckets) != sorted(set(buckets)):
        raise UserError(
            f"lengths.buckets must be increasing lengths > 0, got {list(buckets)}: list each "
            "length once, shortest first"
        )
    return Lengths(group_batches, buckets, token_budget)


def example_lengths(source: ArraySource | RecordExamples) -> np.ndarray | None:
    """Each example's length (its longest ragged part, or as kept), or None if not known."""
    if isinstance(source, RecordExamples):
        return None if source.lengths is None else np.asarray(source.lengths, np.int64)
    ragged = [a for a in tf.nest.flatten(source.arrays) if isinstance(a, tf.RaggedTensor)]
    if not ragged:
        return None
    return np.max([a.row_lengths().numpy() for a in ragged], axis=0).astype(np.int64)


def check(
    lengths: Lengths,
    source: ArraySource | RecordExamples | None,
    name: str,
    sources: int,
    preprocessed=False,
) -> None:
    """Refuses knobs the source cannot take, and examples no bucket holds, in one line.

    ``source`` is the examples read by index (in memory, or records), or None when
    they are read in sequence; ``preprocessed`` says whether they are as batched (else a
    bucket is checked as each batch is padded).
    """
    if not lengths.active:
        return
    if source is None:
        raise UserError(
            f"lengths.group_batches, buckets and token_budget need {name}'s examples read "
            "by index: make it an ArraySource or RecordExamples, or unbind them"
        )
    found = example_lengths(source)
    if found is None and isinstance(source, RecordExamples):
        knob = "group_batches sorts" if lengths.group_batches else "token_budget sizes batches of"
        if not (lengths.group_batches or lengths.token_budget):
            return  # buckets need no lengths beforehand: each batch is checked as padded
        raise UserError(
            f"lengths.{knob} {name}'s examples by length, but its records on disk have no "
            "lengths kept beside them: prepare the data again (prepare --text keeps them), "
            "raise pipeline.memory_limit_mb to hold it in memory, or unbind it"
        )
    if found is None:
        raise UserError(
            f"lengths.group_batches, buckets and token_budget order, pad and size batches of "
            f"examples that vary in length, but {name}'s are all of one shape: unbind them"
        )
    if lengths.group_batches and sources > 1:
        raise UserError(
            f"lengths.group_batches groups one source by length; {name} mixes {sources}: "
            "concatenate them into one ArraySource, or unbind it"
        )
    if preprocessed and lengths.buckets and found.max() > lengths.buckets[-1]:
        _refuse_over_long(f"{int((found > lengths.buckets[-1]).sum()):,}", found, lengths, name)


def check_kept(lengths: Lengths, source: RecordExamples, preprocess, name: str) -> None:
    """Refuses, before training, records on disk that no bucket holds once preprocessed.

    Their kept lengths are as written, and ``preprocess`` may cut them, so only the
    records whose kept length passes the last bucket are read, and measured as they
    will be batched: at most ``PROBED`` of them (any past that are checked as their
    batch is padded, as records without kept lengths are).
    """
    if not lengths.buckets or source.lengths is None:
        return
    last = lengths.buckets[-1]
    flagged = np.flatnonzero(np.asarray(source.lengths) > last)
    if not flagged.size:
        return
    probed = source.examples(tf.data.Dataset.from_tensor_slices(flagged[:PROBED]))
    probed = probed.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE).map(_longest_part)
    found = np.fromiter(probed.as_numpy_iterator(), np.int64)
    if found.max() > last:
        over = int((found > last).sum())
        count = f"at least {over:,}" if flagged.size > PROBED else f"{over:,}"
        _refuse_over_long(count, found, lengths, name)
    logging.info(
        "%s: the %s records kept longer than lengths.buckets' last (%d) that were read fit "
        "it once preprocessed%s",
        name,
        f"{min(flagged.size, PROBED):,}",
        last,
        f"; {flagged.size - PROBED:,} more are checked as their batch is padded"
        if flagged.size > PROBED
        else "",
    )


@tf.autograph.experimental.do_not_convert
def _longest_part(*example) -> tf.Tensor:
    """One preprocessed example's length: its longest part whose length varies (else 0)."""
    varying = [
        tf.shape(t, out_type=tf.int64)[0]
        for t in tf.nest.flatten(example)
        if t.shape.rank and t.shape[0] is None
    ]
    return tf.reduce_max(tf.stack(varying)) if varying else tf.constant(0, tf.int64)


def _refuse_over_long(count: str, found: np.ndarray, lengths: Lengths, name: str):
    raise UserError(
        f"{count} examples of {name} are longer than the last of lengths.buckets "
        f"({lengths.buckets[-1]}; the longest has {found.max()}): add a bucket of at "
        "least that length, or cut them in preprocess"
    )


class Grouped:
    """An ``Order`` whose windows of ``window`` stream positions are sorted by length.

    Within a window, examples go longest first; the part of a window in the next
    epoch is sorted after the part in this one. Positions are still a pure function of
    ``(seed, position)``.

    Args:
      order: the random order of one source.
      lengths: each example's length.
      window: positions per window, a multiple of the global batch.
    """

    def __init__(self, order: Order, lengths: np.ndarray, window: int, name: str = "data"):
        (self.size,) = order.sizes
        self.order, self.window, self.seed = order, int(window), order.seed
        self.longest = int(lengths.max())
        with tf.init_scope():  # made once, eagerly: datasets capture it
            self._lengths = tf.constant(lengths, tf.int64)
        logging.info(
            "Grouping %s by length: windows of %s examples of the training order, each "
            "sorted longest first (lengths %d to %d)",
            name,
            f"{self.window:,}",
            lengths.min(),
            self.longest,
        )

    @tf.autograph.experimental.do_not_convert
    def rows(self, positions: tf.Tensor) -> tf.Tensor:
        """The row of each stream position (a batch of them: one window, or two)."""
        positions = tf.cast(positions, tf.int64)
        starts = positions // self.window * self.window
        windows, which = tf.unique(starts)
        sorted_rows = tf.map_fn(self._sorted, windows)  # [windows, window]
        return tf.gather_nd(
            sorted_rows, tf.stack([tf.cast(which, tf.int64), positions - starts], axis=-1)
        )

    def _sorted(self, start: tf.Tensor) -> tf.Tensor:
        """The rows of the window starting at ``start``: by epoch, then longest first."""
        positions = start + tf.range(self.window, dtype=tf.int64)
        rows = self.order.rows(positions)
        epoch = positions // self.size - start // self.size  # 0, or 1 past the epoch's end
        key = epoch * (self.longest + 1) + self.longest - tf.gather(self._lengths, rows)
        return tf.gather(rows, tf.argsort(key, stable=True))


@tf.autograph.experimental.do_not_convert
def padded(batch, buckets: Sequence[int] = ()):
    """The batch with its ragged parts (examples that vary in length) padded with zeros.

    Each is padded to its longest example, or with ``buckets`` to the smallest bucket
    that holds it.
    """
    return tf.nest.map_structure(
        lambda t: _dense(t, buckets) if isinstance(t, tf.RaggedTensor) else t, batch
    )


def _dense(ragged: tf.RaggedTensor, buckets: Sequence[int]) -> tf.Tensor:
    if not buckets:
        return ragged.to_tensor()
    bounds = tf.constant(buckets, tf.int64)
    longest = ragged.bounding_shape()[1]
    length = tf.gather(bounds, tf.searchsorted(bounds, tf.minimum(longest, bounds[-1])[None])[0])
    message = f"an example is longer than the last of lengths.buckets ({buckets[-1]})"
    return padded_to(ragged, length, message)


@tf.autograph.experimental.do_not_convert
def padded_to(ragged: tf.RaggedTensor, length: tf.Tensor, message: str) -> tf.Tensor:
    """``ragged`` padded with zeros to ``length``; an example longer fails, with ``message``.

    Its static dimensions are kept (the pipeline sets the batch size).
    """
    shape = ragged.bounding_shape()
    fits = tf.debugging.assert_less_equal(shape[1], length, message=message)
    with tf.control_dependencies([fits]):
        dense = ragged.to_tensor(shape=tf.tensor_scatter_nd_update(shape, [[1]], [length]))
    dense.set_shape(ragged.shape[:1].concatenate([None]).concatenate(ragged.shape[2:]))
    return dense
