"""Compiled steps: one step function, and the one loop that calls it.

Only this module touches the model during training. ``train_loop(iterator, n)`` runs
``n`` steps in one ``tf.function`` call so that per-call overhead is paid once per
block, not once per step; the Python loop in ``training.py`` picks ``n``. What
differs between one device, towers and a strategy's replicas is asked of
``distribution.Placement``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import keras
import tensorflow as tf

from trainer import batch_gradients, batch_statistics, custom_step, internals, layer_losses
from trainer.distribution import Placement
from trainer.errors import UserError
from trainer.groups import Plan
from trainer.losses import (
    batch_loss,
    batch_size_of,
    reported_scalars,
    total_loss,
    with_mean_weight,
)
from trainer.metrics import MetricSums, split_metrics
from trainer.model_fn import Mode, ModelFn, Weighted
from trainer.optimization import WeightAverage
from trainer.parallel import make_parallel
from trainer.updates import Updates

STACKED_BYTES = 256 * 2**20  # most memory one jit_compile block's stacked batches take


def stackable_steps(element_spec) -> int:
    """How many training batches of this shape fit in ``STACKED_BYTES`` (at least one)."""
    specs = tf.nest.flatten(element_spec)
    if not all(s.shape.is_fully_defined() for s in specs):
        shapes = [s.shape.as_list() for s in specs]
        raise UserError(
            f"Estimator.jit_compile needs training batches of one fixed shape, got {shapes}: "
            "batch with drop_remainder=True (the pipelines in datasets/ do)"
        )
    size = sum(s.shape.num_elements() * s.dtype.size for s in specs)
    return max(1, STACKED_BYTES // max(size, 1))


def split_element(element, mode: Mode):
    """Splits a dataset element into ``(features, labels)``; labels are None in PREDICT.

    An element ``(features, labels, sample_weight)`` gives ``Weighted`` labels.
    """
    if isinstance(element, tuple) and len(element) == 3:
        features, labels = element[0], Weighted(*element[1:])
    elif isinstance(element, tuple) and len(element) == 2:
        features, labels = element
    else:
        features, labels = element, None
    return features, (None if mode == Mode.PREDICT else labels)


class Steps:
    """The compiled train, eval and predict functions of one model and its optimizers.

    One step function (``_step``) serves one device, towers and a strategy's
    replicas; one loop (``_steps``) runs it, fed by one of three ways of fetching a
    batch: read when the step needs it (``_train_loop``), read ahead onto the device
    (``_prefetching_train_loop``), or sliced from a block of batches stacked for XLA
    (``_stacked_train_loop``). A model whose optimizers do not all update at every
    step (groups taking turns, variables frozen until a step) has one step function
    per phase of its ``plan``, chosen from the global step.

    Args:
      model_fn: the model.
      plan: its units (built Keras optimizers over their variables) and phases.
      by_group: whether ``Spec.loss`` is a dict of one loss per group.
      global_step: incremented once per applied training step.
      metric_names: the per-example metrics the model's Spec returns.
      streamed_metrics: the Keras metrics it names with their inputs, evaluated only.
      placement: where the steps run: towers over this process's devices, a
        strategy's replicas (evaluation is split over them; prediction runs on each
        worker's first device), and the device batches are prefetched to.
      clip_gradient_norm: clip gradients to this global norm (None: no clipping).
      ema: a WeightAverage to update after each step, or None.
      jit_compile: compile each block of steps with XLA as one computation, fed by
        the block's batches stacked (``_stacked_train_loop``).
      microbatches: take each step's batch in this many slices (``microbatch.py``).
    """

    def __init__(
        self,
        model_fn: ModelFn,
        plan: Plan,
        global_step: tf.Variable,
        metric_names: Sequence[str],
        streamed_metrics: Mapping[str, keras.metrics.Metric],
        placement: Placement,
        clip_gradient_norm: float | None = None,
        ema: WeightAverage | None = None,
        jit_compile: bool = False,
        scalar_names: Sequence[str] = (),
        by_group: bool = False,
        microbatches: int = 1,
    ):
        self.model_fn, self.plan, self.global_step = model_fn, plan, global_step
        self.microbatches = microbatches
        self.placement = placement
        self.ema = ema
        self.weights = [
            v
            for v in model_fn.trainable_variables + model_fn.non_trainable_variables
            if tf.as_dtype(v.dtype).is_floating
        ]
        self.has_regularization = bool(model_fn.regularization_losses)
        if microbatches > 1 or placement.num_replicas > 1:
            layer_losses.say_how_cut_batches_take(layer_losses.own_adders(model_fn.layers))
        self.towers = placement.towers(model_fn)
        batch_statistics.check_synchronized(model_fn.layers, microbatches, self.towers is not None)
        self.batch_state = batch_statistics.parts_of(model_fn)  # over slices and replicas
        self.own_step = custom_step.has_own_step(model_fn)  # ModelFn.train_step
        self.count_metrics(Mode.TRAIN, metric_names, {}, scalar_names)
        self.count_metrics(Mode.EVAL, metric_names, streamed_metrics, scalar_names)
        self.times_input = not _op_determinism()  # tf.timestamp is refused under it
        with tf.init_scope():
            # A step's loss was NaN or Inf: the block ended there, the step not counted.
            self.nonfinite = tf.Variable(False, trainable=False, name="nonfinite")
            # After the block some weight is NaN or Inf (its step is not known).
            self.nonfinite_weights = tf.Variable(False, trainable=False, name="nonfinite_weights")
            # The global norm of the gradients of each block's last step.
            self.gradient_norm = tf.Variable(float("nan"), trainable=False, name="gradient_norm")
            self.input_seconds = tf.Variable(
                0.0, dtype=tf.float64, trainable=False, name="input_wait"
            )
        self.updates = Updates(plan, placement, clip_gradient_norm, by_group)
        self._compiled_block = _function(self._train_stacked, jit_compile=True)
        if jit_compile:
            loop = self._stacked_train_loop
        elif placement.prefetch_device:
            loop = self._prefetching_train_loop
        else:
            loop = self._train_loop
        self.train_loop = _function(loop)
        self.evaluate = _function(self._evaluate)
        self.predict = _function(self._predict)

    def count_metrics(
        self,
        mode: Mode,
        names: Sequence[str],
        streamed: Mapping[str, keras.metrics.Metric],
        scalars: Sequence[str] = (),
    ) -> None:
        """Sums ``names`` (and ``streamed``, in EVAL) in ``mode``'s steps from now on.

        ``scalars`` are the Spec's per-batch scalars, averaged as the loss is. Called
        before that mode's step is first traced: a traced step keeps the sums it was
        traced with.
        """
        per_batch = ["loss", *scalars]
        per_batch += ["regularization_loss"] if self.has_regularization else []
        if mode == Mode.TRAIN:
            self.train_metrics = MetricSums(names, per_batch, self.placement.per_replica)
        else:
            self.eval_metrics = MetricSums(
                names, per_batch, per_replica=self.placement.per_replica, streamed=streamed
            )

    # ------------------------------------------------------------ the step

    def _step(self, features, labels, last_of_block: tf.Tensor, phase=None):
        """One step (one replica's part under a strategy): ``(finite, gradient norm)``.

        ``phase``: the units to update (``groups.Plan.phases``); all by default.

        The update is applied either way: a branch around it keeps XLA from fusing
        it into the step and costs a small model ~15% of its speed. The loop ends the
        block at a non-finite loss, before anything is saved, and the global step does
        not count that step. The gradients are not checked each step (a pass over all
        of them costs the MLP another ~15% under XLA on CPU): a NaN or Inf gradient
        leaves NaN or Inf weights for good, and the loops check the weights once per
        block (``_check_weights``). For the same reason the gradient norm is measured
        at the block's last step (at every step when clipping needs it; NaN otherwise).
        """
        phase = self.plan.phases[0] if phase is None else phase
        # Batch norm whose weights wait for frozen_until_step runs as Keras runs a
        # frozen layer: normalised by its moving statistics, which stay as they are.
        frozen = batch_statistics.frozen_norms(self.model_fn.layers, self.plan.frozen(phase))
        with batch_statistics.inference_mode(frozen):
            if self.own_step:
                objective, scalars, metrics, gradients = custom_step.run(
                    self, features, labels, phase
                )
                self.train_metrics.update(metrics, scalars, batch_size_of(features))
                finite = batch_gradients.finite(objective)
            else:
                finite, gradients = batch_gradients.of_batch(self, features, labels, phase)
        norm = self.updates.apply(gradients, phase, last_of_block)
        return self.placement.all_finite(finite), norm

    def _run_step(self, features, labels, last_of_block: tf.Tensor):
        """The step of the phase the global step is in: ``(finite, gradient norm)``."""
        args = (features, labels, last_of_block)
        if len(self.plan.phases) == 1:
            return self.placement.run(self._step, args)

        def branch(phase):  # defined here so that AutoGraph converts the model's code
            def run():
                return self.placement.run(functools.partial(self._step, phase=phase), args)

            return run

        branches = [branch(phase) for phase in self.plan.phases]
        return tf.switch_case(self.plan.phase_index(self.global_step), branches)

    # ------------------------------------------------------------ the loop

    def _steps(self, num_steps: tf.Tensor, fetch: Callable, carried=()) -> None:
        """Runs up to ``num_steps`` steps; stops early, setting ``nonfinite``, on a bad one.

        ``fetch(i, carried) -> (element, carried)`` gives step ``i`` its batch;
        ``carried`` is what one fetch hands the next (a batch read ahead).
        """
        self.nonfinite.assign(False)
        for i in tf.range(num_steps):
            element, carried = fetch(i, carried)
            features, labels = split_element(element, Mode.TRAIN)
            last = i == num_steps - 1
            finite, norm = self._run_step(features, labels, last)
            if last:
                self.gradient_norm.assign(norm)
            if self.ema is not None:
                self.ema.update(first=self.global_step == 0)
            self.global_step.assign_add(tf.cast(finite, tf.int64))
            if not finite:
                self.nonfinite.assign(True)
                break

    def _train_loop(self, iterator, num_steps: tf.Tensor) -> None:
        """The block, each batch read from ``iterator`` when its step needs it."""
        self._steps(num_steps, lambda i, carried: (self._next(iterator), carried))
        self._check_weights()

    def _prefetching_train_loop(self, iterator, num_steps: tf.Tensor) -> None:
        """The block, each batch read onto the device while the step before it runs.

        Reading batch i + 1 (and copying it to ``prefetch_device``) does not depend on
        step i, so the runtime does both at once and the copy is off the step's path.
        A block still reads exactly its ``num_steps`` batches, so the checkpointed
        iterator position stays exact (a block that ends at a non-finite loss has read
        one batch more, but after one the Estimator restores the checkpoint or stops).
        The wait added to ``input_seconds`` is how long after the previous step ended
        a batch arrived: what the step really waited.
        """
        begun = self._timestamp()
        with tf.control_dependencies([begun]):
            first = self._read_ahead(iterator)
        self.input_seconds.assign_add(first[1] - begun)  # the block's first batch

        def fetch(i, carried):
            element, ready = carried
            # An iteration starts once the previous one's updates are done: the step
            # could start now, and its batch arrives ``ready - started`` later.
            started = self._timestamp(after=i)
            self.input_seconds.assign_add(tf.maximum(ready - started, 0.0))
            if i + 1 < num_steps:
                carried = self._read_ahead(iterator)
            return element, carried

        self._steps(num_steps, fetch, first)
        self._check_weights()

    def _read_ahead(self, iterator):
        """The next training element, copied to ``prefetch_device``, and when it got there."""
        element = next(iterator)
        with tf.device(self.placement.prefetch_device):
            element = tf.nest.map_structure(tf.identity, element)
        return element, self._timestamp(after=element)

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
            element = self._next(iterator)
            arrays = tf.nest.map_structure(lambda array, t, i=i: array.write(i, t), arrays, element)
        self._compiled_block(tf.nest.map_structure(lambda array: array.stack(), arrays))
        self._check_weights()  # here rather than in XLA, which reduces on one thread

    def _train_stacked(self, stacked) -> None:
        """Trains on each ``[batch, ...]`` slice of stacked batches in turn (XLA-compiled)."""
        num_steps = tf.shape(tf.nest.flatten(stacked)[0])[0]
        self._steps(
            num_steps, lambda i, carried: (tf.nest.map_structure(lambda t: t[i], stacked), carried)
        )

    def _check_weights(self) -> None:
        """Sets ``nonfinite_weights`` if, after a block, any model weight is NaN or Inf."""
        finite = [tf.reduce_all(tf.math.is_finite(v)) for v in self.weights]
        self.nonfinite_weights.assign(tf.logical_not(tf.reduce_all(tf.stack(finite))))

    def _next(self, iterator):
        """The next training element; the time spent waiting for it goes to ``input_seconds``.

        With a fast pipeline the element is already prefetched and the wait is
        microseconds; a slow one makes the step wait here, which is what the
        Estimator reports as the input-bound share of the step time.
        """
        if not self.times_input:  # no timestamps to take, nothing to add up
            return next(iterator)
        start = self._timestamp()
        with tf.control_dependencies([start]):
            element = next(iterator)
        self.input_seconds.assign_add(self._timestamp(after=element) - start)
        return element

    def _timestamp(self, after=()) -> tf.Tensor:
        """``tf.timestamp()`` taken once ``after`` is computed; 0 if input is not timed."""
        if not self.times_input:
            return tf.constant(0.0, tf.float64)
        with tf.control_dependencies(tf.nest.flatten(after, expand_composites=True)):
            return tf.timestamp()

    # ------------------------------------------------------------ eval and predict

    def _eval_batch(self, features, labels):
        """``(loss, scalars, per-example metrics)`` of one eval batch, over towers if any."""
        examples = batch_gradients.global_examples(self, batch_size_of(features))
        labels = with_mean_weight(labels, self.placement.total)  # before towers cut it

        def forward(features, labels):  # of a batch, or of a tower's shard of it
            spec, added = layer_losses.forward(self.model_fn, features, labels, Mode.EVAL)
            per_example, streamed = split_metrics(spec.metrics)
            self.eval_metrics.stream(streamed)
            loss = batch_loss(spec, batch_size_of(features), examples)
            scalars = reported_scalars(spec, loss)
            if not self.has_regularization:
                return total_loss(loss), scalars, per_example
            # The loss reported is the one trained: with the layers' losses, as Keras's.
            scalars["regularization_loss"] = layer_losses.total(added)
            return total_loss(loss) + scalars["regularization_loss"], scalars, per_example

        if self.towers is not None:
            loss, scalars, metrics, _ = self.towers.run(forward, features, labels, training=False)
            return loss, scalars, metrics
        return forward(features, labels)

    def _evaluate(self, dataset) -> None:
        """Adds every batch of ``dataset`` to ``eval_metrics``.

        Under a strategy ``dataset`` is distributed (``Placement.eval_input``): each
        replica evaluates its share of every batch, and keeps its own sums.
        """
        for element in dataset:
            self.placement.run(self._eval_update, (element,))

    def _eval_update(self, element) -> tf.Tensor:
        features, labels = split_element(element, Mode.EVAL)
        loss, scalars, metrics = self._eval_batch(features, labels)
        self.eval_metrics.update(metrics, {"loss": loss, **scalars}, batch_size_of(features))
        return tf.constant(True)

    def _predict(self, features):
        def predictions(features):
            return dict(self.model_fn(features, None, Mode.PREDICT).predictions)

        if self.towers is not None:
            return make_parallel(predictions, self.towers.devices, features=features)
        return predictions(features)


def _op_determinism() -> bool:
    """Whether tf.config.experimental.enable_op_determinism() is on (no public getter)."""
    try:
        return internals.op_determinism_enabled()
    except (ImportError, AttributeError):
        return False


def _function(method: Callable, **options) -> Callable:
    """``tf.function(method)``, its retracing counted for this Steps alone.

    TensorFlow counts the traces of every function sharing a code object together,
    so the fifth Estimator in one process (a sweep's fifth trial) warned of
    "excessive retracing" on its first call, though each Steps traces once. A
    ``functools.partial`` has no code object: TensorFlow counts it by itself.
    """
    return tf.function(functools.partial(method), **options)
