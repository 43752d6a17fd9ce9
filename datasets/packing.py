"""Packing: several short examples laid end to end in rows of one length, decided by index.

A batch padded to its longest example wastes what its shorter ones leave. Packed,
each row of ``packing.length`` positions holds as many whole examples as fit, one
after another, and the model is told where each one is:

* ``segment_ids``: 1, 2, ... for the first, second, ... example of a row, 0 for
  padding. Two tokens may attend to each other when their ids are equal and not 0:
  the attention mask is block-diagonal (``models/transformer/blocks.py`` builds it).
* ``positions``: each token's place in its own example, from 0.

What a step reads does not change: step ``t`` of global batch ``G`` still reads the
stream's positions ``[t G, (t + 1) G)`` (``datasets/order.py``), so the training
position stays two integers and a resumed run starts at its exact next batch. Packing
only lays each replica's share of a step out in rows: first fit, longest first.

* Every share of a step has as many rows as the share that needs most (replicas
  then weigh alike), rounded up to ``packing.rows_multiple``: 1 by default; under
  ``jit_compile``, which compiles once per row count, 8 compiles fewer shapes for a
  little padding. A row that holds no example is padding. Rows hold different
  numbers of examples, so a loss per example would weigh them unevenly: packing is
  for a loss per token (``trainer.token_mean``, or a Keras mask), which is exact
  however the rows fall, and micro-batches cut rows as they cut examples.
* An example longer than a row is refused before training, counted: never cut.
* EVAL packs each batch alone; PREDICT does not pack: each example has a row of its
  own (``segment_ids`` 1), so predictions stay one per example.

Cost: a batch's first fit is ``O(b * rows)`` for a share of ``b`` examples, done for
every share of the step (``R`` replicas: ``O(R b rows)``) on the input threads, from
the examples' lengths alone; it grows with the batch and the replicas, not with the
data's size or the step a run resumes at.
"""

from __future__ import annotations

import dataclasses

import gin
import numpy as np
import tensorflow as tf

from datasets.order import Order, replica_shares
from datasets.sources import ArraySource
from trainer import InputParams, UserError
from trainer.tokens import SEGMENTS

POSITIONS = "positions"  # packing adds it and SEGMENTS to the features


@dataclasses.dataclass(frozen=True)
class Packing:
    """Rows of ``length`` positions, their count a multiple of ``rows_multiple``."""

    length: int = 0
    rows_multiple: int = 1

    @property
    def active(self) -> bool:
        """Whether packing is on."""
        return self.length > 0


@gin.configurable("packing")
def options(length: int = 0, rows_multiple: int = 1) -> Packing:
    """The knobs, as bound in gin (``packing.length = 512``).

    Args:
      length: positions per row; 0 does not pack.
      rows_multiple: each batch's rows are a multiple of it.
    """
    return Packing(length, rows_multiple)


def knobs() -> Packing:
    """The bound knobs, checked here, outside gin's call, so a refusal is its one line."""
    found = options()
    for name, value, least in (
        ("length", found.length, 0),
        ("rows_multiple", found.rows_multiple, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UserError(f"packing.{name} must be a whole number >= {least}, got {value!r}")
    return found


def check(packing: Packing, examples: ArraySource | None, name: str) -> np.ndarray:
    """Each example's length, once the source is found fit to pack; refusals in one line.

    ``examples``: the preprocessed ``(features, labels)`` in memory, or None when they
    are not. Knobs that packing does not go with are refused before
    (``batching.REFUSED``).
    """
    if examples is None:
        raise UserError(
            f"packing.length packs examples held in memory, preprocessed, or records whose "
            f"lengths were kept; {name}'s are neither: make it an ArraySource, raise "
            "pipeline.memory_limit_mb, or unbind packing.length"
        )
    features, labels = examples.arrays
    parts = tf.nest.flatten((features, labels))
    per_token = all(isinstance(p, tf.RaggedTensor) and p.ragged_rank == 1 for p in parts)
    _check_parts(features, per_token, name)
    lengths = [p.row_lengths().numpy() for p in parts]
    if any((found != lengths[0]).any() for found in lengths):
        raise UserError(
            f"packing needs all the parts of each of {name}'s examples of one length (tokens "
            "and their labels); some differ: pack them apart, or unbind packing.length"
        )
    return _fitting(packing, lengths[0], name)


def check_records(packing: Packing, spec, lengths: np.ndarray | None, name: str) -> np.ndarray:
    """``check`` for records on disk: ``spec`` one preprocessed example's, ``lengths`` kept.

    Each batch is checked as it is laid out: its examples' lengths must be those kept.
    """
    if lengths is None:
        return check(packing, None, name)
    features, _ = spec
    parts = tf.nest.flatten(spec)
    per_token = all(isinstance(p, tf.TensorSpec) and p.shape.rank == 1 for p in parts)
    _check_parts(features, per_token, name)
    return _fitting(packing, np.asarray(lengths, np.int64), name)


def _check_parts(features, per_token: bool, name: str) -> None:
    if not isinstance(features, dict) or {SEGMENTS, POSITIONS} & set(features):
        raise UserError(
            f"packing adds {SEGMENTS!r} and {POSITIONS!r} to {name}'s features, which must be "
            "a dict without them: rename yours in preprocess"
        )
    if not per_token:
        raise UserError(
            f"packing lays every part of an example out along a row, but some of {name}'s are "
            "one per example (a label, say): make them per token, or unbind packing.length"
        )


def _fitting(packing: Packing, lengths: np.ndarray, name: str) -> np.ndarray:
    """``lengths``, once none is longer than a row; else the count, in one line."""
    over = int((lengths > packing.length).sum())
    if over:
        raise UserError(
            f"{over:,} examples of {name} are longer than a row of packing.length = "
            f"{packing.length} (the longest has {lengths.max()}): raise it, or cut them "
            "in preprocess"
        )
    return lengths.astype(np.int64)


@tf.autograph.experimental.do_not_convert
def first_fit(lengths: tf.Tensor, length: int):
    """Each example's ``(row, offset, segment)`` in rows of ``length``, and rows used.

    ``lengths``: ``[shares, b]``, each share packed apart: its examples placed longest
    first (ties in batch order), each in the first row with room. All ``[shares, b]``
    but the rows used, ``[shares]``.
    """
    lengths = tf.cast(lengths, tf.int64)
    shares, count = tf.shape(lengths, out_type=tf.int64)[0], tf.shape(lengths)[1]
    order = tf.argsort(-lengths, axis=1, stable=True)
    needs = tf.gather(lengths, order, batch_dims=1)
    share = tf.range(shares)
    empty = tf.zeros_like(lengths)

    def place(i, room, held, row, offset, segment):
        need = needs[:, i]
        fits = tf.argmax(room >= need[:, None], axis=1)  # the first row with room
        at = tf.stack([share, fits], axis=1)
        left, before = tf.gather_nd(room, at), tf.gather_nd(held, at)
        example = tf.stack([share, tf.cast(order[:, i], tf.int64)], axis=1)
        return (
            i + 1,
            tf.tensor_scatter_nd_sub(room, at, need),
            tf.tensor_scatter_nd_add(held, at, tf.ones_like(need)),
            tf.tensor_scatter_nd_update(row, example, fits),
            tf.tensor_scatter_nd_update(offset, example, length - left),
            tf.tensor_scatter_nd_update(segment, example, before + 1),
        )

    start = (
        0,
        tf.fill(tf.shape(lengths), tf.constant(length, tf.int64)),
        empty,
        empty,
        empty,
        empty,
    )
    _, _, _, row, offset, segment = tf.while_loop(lambda i, *_: i < count, place, start)
    return row, offset, segment, tf.reduce_max(row, axis=1) + 1


def _rounded(rows: tf.Tensor, multiple: int) -> tf.Tensor:
    return (rows + multiple - 1) // multiple * multiple


@tf.autograph.experimental.do_not_convert
def laid_out(batch, row, offset, segment, rows, length: int):
    """The batch's ragged parts scattered into ``[rows, length]``, with segments and positions.

    ``row``, ``offset``, ``segment``: each example's place, as ``first_fit`` gives.
    """
    features, labels = batch
    first = tf.nest.flatten(batch)[0]
    example = first.value_rowids()
    within = tf.range(tf.shape(example, out_type=tf.int64)[0]) - tf.gather(
        first.row_splits, example
    )
    at = tf.stack([tf.gather(row, example), tf.gather(offset, example) + within], axis=1)
    rows = tf.cast(rows, tf.int64)

    def scattered(values):
        shape = tf.concat(
            [
                tf.stack([rows, tf.constant(length, tf.int64)]),
                tf.shape(values, out_type=tf.int64)[1:],
            ],
            0,
        )
        dense = tf.scatter_nd(at, values, shape)
        dense.set_shape([None, length, *values.shape[1:]])
        return dense

    features = {k: scattered(v.values) for k, v in features.items()}
    labels = tf.nest.map_structure(lambda t: scattered(t.values), labels)
    features[SEGMENTS] = tf.cast(scattered(tf.gather(segment, example)), tf.int32)
    features[POSITIONS] = tf.cast(scattered(within), tf.int32)
    return features, labels


class Packer:
    """Lays the batches of one pipeline out in rows, for each mode.

    Args:
      packing: the knobs.
      lengths: each example's length, by row of the source (``check``).
      order: the training order (None outside training).
      params: the pipeline's batch, shard and position.
      kept: ``lengths`` were kept beside records on disk, not measured on the examples:
        each training batch is checked against them.
    """

    def __init__(
        self,
        packing: Packing,
        lengths: np.ndarray,
        order: Order | None,
        params: InputParams,
        kept: bool = False,
    ):
        self.packing, self.order, self.params, self.kept = packing, order, params, kept
        with tf.init_scope():  # made once, eagerly: datasets capture it
            self._lengths = tf.constant(lengths, tf.int64)

    @tf.autograph.experimental.do_not_convert
    def training(self, batch, elements: tf.Tensor):
        """A training batch of this pipeline (its ``elements``), as rows its step's shares share."""
        shares, own = step_shares(elements, self.params)
        rows_of = tf.reshape(self.order.rows(tf.reshape(shares, [-1])), tf.shape(shares))
        needs = tf.gather(self._lengths, rows_of)
        if self.kept:
            fits = tf.debugging.assert_equal(
                tf.nest.flatten(batch)[0].row_lengths(),
                needs[own],
                message="packing: an example's length is not the one kept beside its record "
                "(a preprocess that changes lengths cannot be packed from disk)",
            )
            with tf.control_dependencies([fits]):
                needs = tf.identity(needs)
        row, offset, segment, used = first_fit(needs, self.packing.length)
        rows = _rounded(tf.reduce_max(used), self.packing.rows_multiple)
        return laid_out(batch, row[own], offset[own], segment[own], rows, self.packing.length)

    @tf.autograph.experimental.do_not_convert
    def evaluation(self, batch):
        """An eval batch, packed alone."""
        needs = tf.nest.flatten(batch)[0].row_lengths()[None]
        row, offset, segment, used = first_fit(needs, self.packing.length)
        rows = _rounded(used[0], self.packing.rows_multiple)
        return laid_out(batch, row[0], offset[0], segment[0], rows, self.packing.length)

    @staticmethod
    @tf.autograph.experimental.do_not_convert
    def prediction(batch):
        """A predict batch, one example a row, padded to its longest, with segment 1."""
        features, labels = batch
        lengths = tf.nest.flatten(batch)[0].row_lengths()
        padded = {k: v.to_tensor() for k, v in features.items()}
        real = tf.sequence_mask(lengths, tf.reduce_max(lengths), dtype=tf.int32)
        padded[SEGMENTS] = real
        padded[POSITIONS] = real * tf.range(tf.shape(real)[1])[None]
        return padded, tf.nest.map_structure(lambda t: t.to_tensor(), labels)


@tf.autograph.experimental.do_not_convert
def step_shares(elements: tf.Tensor, params: InputParams) -> tuple[tf.Tensor, tf.Tensor]:
    """The stream positions of every share of the step a batch of ``elements`` belongs to.

    ``[replicas, b]``, and which of them this pipeline's batch is (as
    ``order.pipeline_positions`` deals them out).
    """
    b = params.batch_size
    replicas, local, first = replica_shares(params)
    k = tf.cast(elements[0], tf.int64) // b
    start = params.start_example + (k // local) * params.global_batch_size
    positions = start + tf.reshape(tf.range(replicas * b, dtype=tf.int64), [replicas, b])
    return positions, first + k % local
