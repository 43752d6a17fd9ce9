"""How a block of training steps gets its batches, and how the block is compiled.

``Steps._steps(source, n)`` runs ``n`` steps in one ``tf.function`` call, each step
taking its batch by ``fetch(i, carried)`` (``Feeder.fetching``). The batches come one
of three ways:

* read when the step needs it (``Feeder.next``), the wait timed;
* read onto ``Devices.prefetch``'s device while the step before runs, so the copy is
  off the step's path (``Feeder``'s read-ahead);
* under ``Devices.jit_compile``, the block's batches read first and stacked into
  ``[n, batch, ...]`` tensors, so that one XLA computation runs every step of the
  block (``Blocks``); batches whose lengths vary are each a compiled block of one
  instead, XLA compiling the step once per shape.

Which of the last two, and how many batches one block stacks, is decided once from
the training batches' shapes (``Blocks.fit``): the loop says only whether the stream
is sized by examples that vary (``model_fn.sized_by``).

The wait for input (``Feeder.input_seconds``) is what the Estimator reports as the
input-bound share of the step time (``monitoring.InputWait``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import tensorflow as tf
from absl import logging as absl_logging

from trainer import internals
from trainer.errors import UserError

STACKED_BYTES = 256 * 2**20  # most memory one jit_compile block's stacked batches take


def stackable_steps(element_spec) -> int:
    """How many training batches of this shape fit in ``STACKED_BYTES`` (at least one).

    0 for batches whose lengths vary (padded to buckets, ``datasets/lengths.py``):
    they are not stacked, and each step is compiled once per shape.
    """
    specs = tf.nest.flatten(element_spec)
    if not all(s.shape.rank and s.shape[:1].is_fully_defined() for s in specs):
        shapes = [s.shape.as_list() for s in specs]
        raise UserError(
            f"Devices.jit_compile needs training batches of one fixed size, got {shapes}: "
            "batch with drop_remainder=True (the pipelines in datasets/ do)"
        )
    if not all(s.shape.is_fully_defined() for s in specs):
        return 0
    size = sum(s.shape.num_elements() * s.dtype.size for s in specs)
    return max(1, STACKED_BYTES // max(size, 1))


class Feeder:
    """Each step's batch, fetched one of three ways, and the time spent waiting for it.

    Args:
      prefetch_device: the device each batch is read onto while the step before runs,
        or None.
      stacked: the batches come stacked (``Blocks`` under jit_compile).
    """

    def __init__(self, prefetch_device: str | None, stacked: bool):
        self.prefetch_device, self.stacked = prefetch_device, stacked
        self.times_input = not _op_determinism()  # tf.timestamp is refused under it
        with tf.init_scope():
            self.input_seconds = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="input_wait"
            )

    @tf.autograph.experimental.do_not_convert
    def fetching(self, source, num_steps: tf.Tensor):
        """``(fetch, carried)``: how step ``i`` gets its batch, ``fetch(i, carried)``.

        ``carried`` is what one fetch hands the next (a batch read ahead). Three ways:
        sliced from stacked batches (jit_compile); read onto ``prefetch_device`` while
        the step before runs; or read when the step needs it.
        """
        if self.stacked:
            return lambda i, carried: (tf.nest.map_structure(lambda t: t[i], source), carried), ()
        if self.prefetch_device:
            return self._prefetching(source, num_steps)
        return lambda i, carried: (self.next(source), carried), ()

    @tf.autograph.experimental.do_not_convert
    def _prefetching(self, iterator, num_steps: tf.Tensor):
        """Each batch read onto the device while the step before it runs.

        Reading batch i + 1 (and copying it to ``prefetch_device``) does not depend on
        step i, so the runtime does both at once and the copy is off the step's path.
        A block still reads exactly its ``num_steps`` batches, so the checkpointed
        iterator position stays exact (a block that ends at a non-finite loss has read
        one batch more, but after one the Estimator restores the checkpoint or stops).
        The wait is counted after each step (``count_wait``).
        """
        begun = self.timestamp()
        with tf.control_dependencies([begun]):
            first = self._read_ahead(iterator)
        self.input_seconds.assign_add(first[1] - begun)  # the block's first batch

        def fetch(i, carried):
            element, _ = carried
            if i + 1 < num_steps:
                carried = self._read_ahead(iterator)
            return element, carried

        return fetch, first

    @tf.autograph.experimental.do_not_convert
    def count_wait(self, carried, updated: list) -> None:
        """Adds how long after this step's ``updated`` values the batch read ahead arrived.

        Timed here, not when the next iteration starts: an iteration of the loop starts
        only once every op of the one before has run, the read-ahead among them, so its
        start never precedes the batch. After the block's last step ``carried`` is the
        batch that step took, which arrived before the update: nothing is added.
        """
        if not carried or not self.times_input:  # read when needed: timed in next
            return
        done = self.timestamp(after=[tf.identity(v) for v in updated])
        self.input_seconds.assign_add(tf.maximum(carried[1] - done, 0.0))

    @tf.autograph.experimental.do_not_convert
    def _read_ahead(self, iterator):
        """The next training element, copied to ``prefetch_device``, and when it got there."""
        element = next(iterator)
        with tf.device(self.prefetch_device):
            element = tf.nest.map_structure(tf.identity, element)
        return element, self.timestamp(after=element)

    @tf.autograph.experimental.do_not_convert
    def next(self, iterator):
        """The next training element; the time spent waiting for it goes to ``input_seconds``.

        With a fast pipeline the element is already prefetched and the wait is
        microseconds; a slow one makes the step wait here, which is what the
        Estimator reports as the input-bound share of the step time.
        """
        if not self.times_input:  # no timestamps to take, nothing to add up
            return next(iterator)
        start = self.timestamp()
        with tf.control_dependencies([start]):
            element = next(iterator)
        self.input_seconds.assign_add(self.timestamp(after=element) - start)
        return element

    @tf.autograph.experimental.do_not_convert
    def timestamp(self, after=()) -> tf.Tensor:
        """``tf.timestamp()`` taken once ``after`` is computed; 0 if input is not timed."""
        if not self.times_input:
            return tf.constant(0.0, tf.float64)
        with tf.control_dependencies(tf.nest.flatten(after, expand_composites=True)):
            return tf.timestamp()


class Blocks:
    """``run(iterator, n)``: ``n`` training steps in one compiled call.

    Args:
      steps: ``steps(source, n)``, the loop of ``n`` steps (``Steps._steps``).
      check_weights: sets the flag of non-finite weights, after a block.
      nonfinite: the flag the loop sets when a step's loss is not finite.
      feeder: what reads the batches (and stacks them, under jit_compile).
      jit_compile: each block one XLA computation, fed its batches stacked.
    """

    def __init__(
        self,
        steps: Callable,
        check_weights: Callable[[], None],
        nonfinite: tf.Variable,
        feeder: Feeder,
        jit_compile: bool,
    ):
        self.steps, self.check_weights, self.nonfinite = steps, check_weights, nonfinite
        self.feeder = feeder
        self._compiled_block = own_function(self._train_stacked, jit_compile=True)
        self.run = own_function(self._stacked_train_loop if jit_compile else steps)
        self.jit_compile = jit_compile

    def fit(self, element_spec, sized: bool, steps_per_loop: int) -> int:
        """How many steps one block runs, for training batches of ``element_spec``.

        Under jit_compile a block's batches are stacked, as many as fit in memory;
        batches whose lengths vary (or, ``sized``, whose examples vary: a token budget
        gives a size per bucket) are fed one at a time, compiled once per shape.
        """
        if not self.jit_compile:
            return steps_per_loop
        stackable = 0 if sized else stackable_steps(element_spec)
        if stackable:
            return min(steps_per_loop, stackable)
        self._compile_per_shape()
        absl_logging.info(
            "jit_compile: the training batches vary in length, so XLA compiles the "
            "step once per shape (bound them with lengths.buckets)"
        )
        return steps_per_loop

    def _stacked_train_loop(self, iterator, num_steps: tf.Tensor) -> None:
        """The block compiled by XLA as one cluster, fed its batches stacked.

        Iterator ops cannot be compiled, so the block's batches are read first and
        stacked into ``[num_steps, batch, ...]`` tensors; one XLA computation then runs
        every step of the block, with no executor overhead between steps.
        """
        num_steps = tf.cast(num_steps, tf.int32)
        arrays = tf.nest.map_structure(
            lambda spec: tf.TensorArray(spec.dtype, size=num_steps, element_shape=spec.shape),
            iterator.element_spec,
        )
        for i in tf.range(num_steps):
            element = self.feeder.next(iterator)
            arrays = tf.nest.map_structure(lambda array, t, i=i: array.write(i, t), arrays, element)
        self._compiled_block(tf.nest.map_structure(lambda array: array.stack(), arrays))
        self.check_weights()  # here rather than in XLA, which reduces on one thread

    def _compile_per_shape(self) -> None:
        """Under jit_compile, for batches whose lengths vary: fed one at a time.

        Each batch goes to the XLA-compiled block as a block of one, so XLA compiles
        the step once per shape (a few, with ``lengths.buckets``) rather than a block
        of batches stacked, which one shape needs. ``compiled_shapes`` counts them;
        TensorFlow's warning of "excessive retracing" is dropped, as each is expected.
        """
        self.run = self._train_shape_by_shape
        logger = tf.get_logger()
        if not any(isinstance(f, _OneTracePerShape) for f in logger.filters):
            logger.addFilter(_OneTracePerShape())

    def traces(self) -> int:
        """How many times the training loop was traced (compiled): one block's first run."""
        if self.run == self._train_shape_by_shape:
            return self.compiled_shapes
        return self.run.experimental_get_tracing_count()

    @property
    def compiled_shapes(self) -> int:
        """How many batch shapes the XLA-compiled block was compiled for."""
        return self._compiled_block.experimental_get_tracing_count()

    def _train_shape_by_shape(self, iterator, num_steps: tf.Tensor) -> None:
        """Up to ``num_steps`` steps, each its batch as a compiled block of one."""
        for _ in range(int(num_steps)):
            element = self.feeder.next(iterator)
            self._compiled_block(tf.nest.map_structure(lambda t: t[None], element))
            if self.nonfinite.numpy():
                break
        self.check_weights()

    def _train_stacked(self, stacked) -> None:
        """Trains on each ``[batch, ...]`` slice of stacked batches in turn (XLA-compiled)."""
        self.steps(stacked, tf.shape(tf.nest.flatten(stacked)[0])[0])


class _OneTracePerShape(logging.Filter):
    """Drops the "excessive retracing" warning of a step compiled once per batch shape."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("_train_stacked" in message and "retracing" in message)


def _op_determinism() -> bool:
    """Whether tf.config.experimental.enable_op_determinism() is on (no public getter)."""
    try:
        return internals.op_determinism_enabled()
    except (ImportError, AttributeError):
        return False


def own_function(method: Callable, **options) -> Callable:
    """``tf.function(method)``, its retracing counted for this one object alone.

    TensorFlow counts the traces of every function sharing a code object together,
    so the fifth Estimator in one process (a sweep's fifth trial) warned of
    "excessive retracing" on its first call, though each Steps traces once. A
    ``functools.partial`` has no code object: TensorFlow counts it by itself.
    """
    return tf.function(functools.partial(method), **options)
