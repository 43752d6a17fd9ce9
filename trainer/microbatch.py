"""Micro-batches: a step's batch taken in slices, their gradients summed, one update.

A batch whose activations do not fit in memory is split inside the compiled step
(``Optimization.microbatches = k``) into ``k`` slices taken one after another in a
``tf.while_loop``, so that one slice's activations are alive at a time. Each slice's
loss is weighted by its share of the batch, so the summed gradients are the whole
batch's (for models without batch statistics) and one update applies them. One step
stays one update: the learning-rate schedule, the moving average, checkpoints and
exact resume count steps as without slices, and under a strategy the replicas'
gradients are still all-reduced once per step. Batch-norm moving statistics move
once per step too, by the whole batch's mean and variance (``batch_statistics``),
though each slice normalises by its own. What it costs: the slices run one after
another, and the summed gradients take one more copy of the weights' size.

``Optimization.microbatch_tokens = n`` chooses the slices of each batch instead: as
many as keep a slice within ``n`` padded positions (``slices_within``), so that a
batch of long sequences is taken in more slices than one of short ones, each within
one memory budget, and each step still one update of its whole batch.

Keras's own ``gradient_accumulation_steps`` is refused: it counts each slice as a
step (the schedule and the average move k times as fast), and in Keras 3.15 it
breaks under tf.distribute strategies.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

from trainer.batch_statistics import Parts
from trainer.errors import UserError


def check_optimizer(optimizer: keras.optimizers.Optimizer, name: str) -> None:
    """Refuses an optimizer that accumulates gradients itself (Keras's own way)."""
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    if steps:
        raise UserError(
            f"{name} has gradient_accumulation_steps={steps}, which counts every slice as a "
            f"step: drop it and set Optimization.microbatches = {steps} (one step stays one "
            "update of the whole batch)"
        )


@tf.autograph.experimental.do_not_convert
def slices_within(features, tokens: int) -> int | tf.Tensor:
    """How many slices keep each within ``tokens`` padded positions, one example at most.

    A slice's positions are its examples times the batch's longest sequence (the
    features' second dimension).

    Where the batch's shape is known when traced (buckets, under ``jit_compile``), a
    number that divides the batch, so that its slices are of one shape; else a tensor.
    """
    sequences = [t for t in tf.nest.flatten(features) if t is not None and t.shape.rank >= 2]
    if not sequences:
        return 1
    batch = tf.shape(sequences[0])[0]
    length = tf.reduce_max(tf.stack([tf.shape(t)[1] for t in sequences]))
    known = tf.get_static_value(batch), tf.get_static_value(length)
    if None not in known:
        needed = max(1, -(-int(known[0]) * int(known[1]) // tokens))
        return next(k for k in range(needed, int(known[0]) + 1) if known[0] % k == 0)
    needed = (batch * length + tokens - 1) // tokens
    return tf.clip_by_value(needed, 1, tf.maximum(batch, 1))


def accumulate(run: Callable, features, labels, k: int | tf.Tensor, variables, state: Parts):
    """Runs ``run(features, labels, fraction) -> (finite, gradients)`` on k slices.

    ``k`` is a number, or a tensor: then the batch's slices are chosen as it runs.
    ``fraction`` is the slice's share of the batch (the slice's loss is to be
    weighted by it); ``gradients`` are arranged as ``variables`` (a list, or a dict
    of lists), None where a variable has none. Returns whether every slice was
    finite, and the slices' gradients summed. A batch of fewer than k examples is
    taken one example at a time; one of n examples not divisible by k in slices
    of n // k and n // k + 1. ``state`` (batch-norm statistics) starts every slice
    where the step started, and ends as the whole batch leaves it.
    """
    batch = tf.shape(tf.nest.flatten(features)[0])[0]
    count, take = _slicing((features, labels), batch, k)
    flat = tf.nest.flatten(variables)
    has_gradient: list[bool] = []  # found when the loop's body is traced

    start = state.start()

    def body(i, finite, sums, moved):
        part, size = take(i)
        fraction = tf.cast(size, tf.float32) / tf.cast(batch, tf.float32)
        state.reset(start)
        part_finite, gradients = run(*part, fraction)
        moved = state.add(moved, start, fraction)
        gradients = tf.nest.flatten(gradients)
        has_gradient[:] = [g is not None for g in gradients]
        sums = [
            s if g is None else s + tf.convert_to_tensor(g)
            for s, g in zip(sums, gradients, strict=True)
        ]
        return i + 1, tf.logical_and(finite, part_finite), sums, moved

    zeros = [tf.zeros(v.shape, v.dtype) for v in flat]
    _, finite, sums, moved = tf.while_loop(
        lambda i, *_: i < count,
        body,
        (tf.constant(0), tf.constant(True), zeros, state.zeros()),
        parallel_iterations=1,  # one slice's activations at a time
    )
    state.finish(moved, start)
    summed = [s if kept else None for s, kept in zip(sums, has_gradient, strict=True)]
    return finite, tf.nest.pack_sequence_as(variables, summed)


def _slicing(batched, batch: tf.Tensor, k: int):
    """``(count, take)``: the number of slices and ``take(i) -> (slice i, its size)``.

    A batch of a size known when traced and divisible by k is reshaped to
    ``[k, size, ...]`` and indexed, as XLA needs; any other is cut where
    ``i * batch // count`` falls.
    """
    known = tf.get_static_value(batch)
    if isinstance(k, int) and known is not None and known >= k and known % k == 0:
        size = int(known) // k
        stacked = tf.nest.map_structure(lambda x: _apply(x, _stack, k, size), batched)
        return k, lambda i: (tf.nest.map_structure(lambda x: _apply(x, _index, i), stacked), size)
    count = tf.minimum(k, batch)

    def take(i):
        start = i * batch // count
        size = (i + 1) * batch // count - start
        return tf.nest.map_structure(lambda x: _apply(x, _rows, start, size), batched), size

    return count, take


def _apply(x, fn, *args):
    """``fn(x, *args)`` of a batched tensor; None and scalars as they are."""
    return x if x is None or x.shape.rank == 0 else fn(x, *args)


def _stack(x, k, size):
    return tf.reshape(x, tf.concat([[k, size], tf.shape(x)[1:]], axis=0))


def _index(x, i):
    return x[i]


def _rows(x, start, size):
    """Rows ``[start, start + size)`` of a batched tensor."""
    return x[start : start + size]
