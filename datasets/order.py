"""The training order as arithmetic: which example sits at each position of the stream.

Training reads one endless stream of examples. Step ``t`` of a run with global batch
``G`` trains on the stream's positions ``[t * G, (t + 1) * G)``, whatever the number of
devices or workers; the Estimator keeps how far the stream has been read (one integer
in each checkpoint) and tells each input_fn where to start (``params.start_example``).
Nothing is replayed and no buffer is saved: every position is a pure function of
``(seed, position)``, as in Grain's index sampler.

* **Mixing** several sources (splits) with weights: the stream is cut into blocks of
  ``MIX_BLOCK`` positions; in each block, source ``s`` owns ``round(weight_s *
  MIX_BLOCK)`` of them, scattered by a stateless permutation keyed by (seed, block).
  The weights hold exactly in every block, and the slots a source owns in block ``b``
  are positions ``[b * owned, (b + 1) * owned)`` of its own stream, so each source is
  still read epoch by epoch (two epochs may interleave within one block).
* **Epochs**: a source of ``n`` examples reads its stream position ``k`` from epoch
  ``k // n``, whose order is a full permutation of ``[0, n)`` keyed by (seed, source,
  epoch): ``tf.random.experimental.index_shuffle``. Each epoch visits every example
  once, in an order that differs between epochs and seeds.
* **Windows**: a source whose rows are decoded in blocks (Parquet's row groups) gives
  its blocks' sizes (``Windows``). Its epoch then shuffles the blocks, and the rows
  within each window of ``window`` consecutive shuffled blocks, each keyed by (seed,
  source, epoch, window): a block is read in one window of the epoch, and every row
  once.
* **Sharding**: pipeline ``i`` of ``P`` (one per worker) serves ``L = R / P`` of the
  ``R`` replicas, each with ``b = G / R`` examples per step. Its ``k``-th batch is
  replica ``i * L + k % L``'s share of step ``k // L``: see ``pipeline_positions``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from trainer import InputParams, UserError

MIX_BLOCK = 1000  # positions per mixing block: weights hold to 1/MIX_BLOCK
_SEED_SALT = 0x5EED_0F_DA7A  # keeps the order's seeds apart from other users of the seed
_WINDOW_SALT = 0x0B10C_5EED  # and a window's permutation apart from its epoch's


class Order:
    """Maps stream positions to ``(source, example index)`` with TF ops (graph-safe).

    Args:
      sizes: how many examples each source holds.
      weights: the share of the stream each source gets (default: equal).
      seed: the run's seed; None draws one (the order is then not reproducible).
      windows: for each source, its ``Windows``, or None for a full shuffle.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float] | None = None,
        seed: int | None = None,
        windows: Sequence[Windows | None] | None = None,
    ):
        sizes = [int(n) for n in sizes]
        self.windows = list(windows) if windows is not None else [None] * len(sizes)
        for i, n in enumerate(sizes):
            if n < 1:
                raise UserError(
                    f"training source {i} is empty: it has no examples to read; check its "
                    "split or slice (e.g. 'train[:0%]' selects nothing)"
                )
        self.sizes = sizes
        self.slots = _slots(weights, len(sizes))
        self.offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        self.seed = int(seed)

    @tf.autograph.experimental.do_not_convert  # plain TF ops: no AutoGraph pass
    def rows(self, positions: tf.Tensor) -> tf.Tensor:
        """The row of each stream position in the sources laid end to end (int64)."""
        positions = tf.cast(positions, tf.int64)
        if len(self.sizes) == 1:
            return self._example(0, positions)
        source, k = self._mix(positions)
        rows = tf.zeros_like(positions)
        for s in range(len(self.sizes)):  # a few sources: a select per source
            rows = tf.where(source == s, self.offsets[s] + self._example(s, k), rows)
        return rows

    @tf.autograph.experimental.do_not_convert
    def source_of(self, positions: tf.Tensor) -> tf.Tensor:
        """Which source each stream position draws from (int64)."""
        if len(self.sizes) == 1:
            return tf.zeros_like(tf.cast(positions, tf.int64))
        return self._mix(tf.cast(positions, tf.int64))[0]

    def _mix(self, positions: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """``(source, position in that source's own stream)`` of each stream position."""
        block, within = positions // MIX_BLOCK, positions % MIX_BLOCK
        slot = _shuffle(within, self._seed(-1, block), MIX_BLOCK)
        bounds = tf.constant(np.cumsum(self.slots), tf.int64)  # slot < bounds[s]: source <= s
        source = tf.reduce_sum(tf.cast(slot[..., None] >= bounds, tf.int64), axis=-1)
        starts = tf.constant(np.concatenate([[0], np.cumsum(self.slots)[:-1]]), tf.int64)
        owned = tf.gather(tf.constant(self.slots, tf.int64), source)
        return source, block * owned + slot - tf.gather(starts, source)

    def _example(self, source: int, k: tf.Tensor) -> tf.Tensor:
        """The example at position ``k`` of ``source``'s own stream: epoch, then permutation."""
        n = self.sizes[source]
        if self.windows[source] is not None:
            epoch_seed = functools.partial(self._seed, source)
            return self.windows[source].example(k, epoch_seed, self._window_seed(source))
        return _shuffle(k % n, self._seed(source, k // n), n)

    def _window_seed(self, source: int):
        """``seed(epoch, window)``: the key of a window's own permutation."""

        def seed(epoch: tf.Tensor, window: tf.Tensor) -> tf.Tensor:
            keys = [tf.fill(tf.shape(epoch), tf.constant(self.seed ^ _WINDOW_SALT, tf.int64))]
            return tf.stack([*keys, (source + 1) * 2**32 + window, epoch], axis=-1)

        return seed

    def _seed(self, source: int, epoch: tf.Tensor) -> tf.Tensor:
        """The permutation's key: (run seed, source, epoch); source -1 is the mixing."""

        def fill(value: int) -> tf.Tensor:
            return tf.fill(tf.shape(epoch), tf.constant(value, tf.int64))

        return tf.stack([fill(self.seed ^ _SEED_SALT), fill(source + 1), epoch], axis=-1)


class Windows:
    """An epoch's order over rows decoded in blocks, a window of blocks at a time.

    The blocks are shuffled, then the rows within each window of ``window``
    consecutive shuffled blocks.

    Args:
      blocks: each block's number of rows, in the source's order.
      window: blocks per window; the last window of an epoch may hold fewer.

    Cost per batch: one shuffle of the blocks for each epoch the batch touches (one,
    or two at an epoch's end), O(blocks), then O(log blocks) per row.
    """

    def __init__(self, blocks: Sequence[int], window: int):
        if int(window) < 1:
            raise UserError(f"a window of {window} blocks: give at least 1")
        self.sizes = np.asarray(blocks, np.int64)
        self.window = int(window)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.rows = int(self.sizes.sum())

    def example(self, k: tf.Tensor, epoch_seed, window_seed) -> tf.Tensor:
        """The row at each position ``k`` of the source's own stream.

        ``epoch_seed(epochs)``: the key of each epoch's shuffle of the blocks;
        ``window_seed(epochs, windows)``: that of each window's shuffle of its rows.
        """
        shape, k = tf.shape(k), tf.reshape(k, [-1])
        count, n, w = len(self.sizes), self.rows, self.window
        epoch, j = k // n, k % n
        epochs, which = tf.unique(epoch, out_idx=tf.int64)  # one, or two at an epoch's end
        slots = tf.tile(tf.range(count, dtype=tf.int64), [tf.size(epochs)])
        keys = epoch_seed(tf.repeat(epochs, count))
        order = tf.reshape(_shuffle(slots, keys, count), [-1, count])  # [epochs, slot]: block
        sizes = tf.gather(tf.constant(self.sizes), order)  # each slot's block's rows
        ends = tf.cumsum(sizes, axis=1)
        starts = ends - sizes
        each = tf.range(tf.size(k, out_type=tf.int64))

        def at(slot):  # (epoch, slot) of each position, to gather by
            return tf.stack([which, slot], -1)

        def slot_of(offset):  # the slot whose rows hold each offset of its epoch
            offsets = tf.tile(offset[None], [tf.size(epochs), 1])
            found = tf.searchsorted(ends, offsets, side="right", out_type=tf.int64)
            return tf.gather_nd(found, tf.stack([which, each], -1))

        window = slot_of(j) // w
        first = tf.gather_nd(starts, at(window * w))
        end = tf.gather_nd(ends, at(tf.minimum(window * w + w, count) - 1))
        within = _shuffle_sized(j - first, window_seed(epoch, window), end - first)
        slot = slot_of(first + within)
        block = tf.gather_nd(order, at(slot))
        row = tf.gather(self.starts, block) + first + within - tf.gather_nd(starts, at(slot))
        return tf.reshape(row, shape)


def _shuffle_sized(index: tf.Tensor, seed: tf.Tensor, sizes: tf.Tensor) -> tf.Tensor:
    """Position ``index`` of a permutation of ``[0, size)``, a size per index."""
    return tf.raw_ops.RandomIndexShuffle(index=index, seed=seed, max_index=sizes - 1, rounds=4)


def _shuffle(index: tf.Tensor, seed: tf.Tensor, n: int) -> tf.Tensor:
    """Position ``index`` of a permutation of ``[0, n)`` chosen by ``seed`` ([..., 3])."""
    if n == 1:
        return tf.zeros_like(index)
    max_index = tf.fill(tf.shape(index), tf.constant(n - 1, tf.int64))
    # The raw op of tf.random.experimental.index_shuffle, whose wrapper pads a batch
    # of seeds along the wrong axis.
    return tf.raw_ops.RandomIndexShuffle(index=index, seed=seed, max_index=max_index, rounds=4)


def _slots(weights: Sequence[float] | None, count: int) -> list[int]:
    """Each source's share of a mixing block, in whole positions summing to MIX_BLOCK."""
    if weights is None:
        weights = [1.0] * count
    weights = [float(w) for w in weights]
    if len(weights) != count:
        raise UserError(f"{len(weights)} mixing weights for {count} sources: give one each")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f"mixing weights must be >= 0 with a positive sum, got {weights}")
    exact = [MIX_BLOCK * w / sum(weights) for w in weights]
    slots = [int(x) for x in exact]
    by_remainder = sorted(range(count), key=lambda s: slots[s] - exact[s])
    for s in by_remainder[: MIX_BLOCK - sum(slots)]:  # largest remainders round up
        slots[s] += 1
    starved = [w for w, n in zip(weights, slots, strict=True) if w > 0 and n == 0]
    if starved:
        raise UserError(
            f"mixing weights {weights}: a weight below 1/{MIX_BLOCK} of their sum is never "
            "drawn; raise it or drop that source"
        )
    return slots


@tf.autograph.experimental.do_not_convert
def pipeline_positions(elements: tf.Tensor, params: InputParams) -> tf.Tensor:
    """The stream position of element ``e`` of this pipeline (its k-th batch's o-th example).

    With ``R`` replicas of ``b`` examples over ``P`` pipelines, each pipeline serves
    ``L = R / P`` replicas: its batch ``k`` is replica ``i * L + k % L``'s share of
    step ``k // L``. Positions count from ``params.start_example``.
    """
    b = params.batch_size
    _, local, first = replica_shares(params)
    k, o = elements // b, elements % b
    replica = first + k % local
    return params.start_example + (k // local) * params.global_batch_size + replica * b + o


def replica_shares(params: InputParams) -> tuple[int, int, int]:
    """``(R, L, first)``: a step's replicas, this pipeline's share, its first replica.

    Pipeline ``i`` of ``P`` serves ``L = R / P`` replicas, from replica ``i * L``.
    """
    replicas = max(params.global_batch_size // params.batch_size, 1)
    local = max(replicas // params.num_input_pipelines, 1)
    return replicas, local, params.input_pipeline_id * local
