"""One training step, from a batch to the update, and the compiled loop that runs it.

Read ``Steps._step`` first: it is the whole step of one replica (the one device, or
one of a strategy's replicas), in two parts.

1. The gradients of the batch's loss (``_gradients``). The batch may be cut: towers
   split it over this process's devices (``towers.Towers``), a strategy's replica
   holds its share of the global batch, micro-batches take it in slices one after
   another (``microbatch.accumulate``). Each part's loss is weighted by its share of
   the batch, so that whatever the cut the gradients are those of the whole batch's
   mean loss. A part's gradients come from the model's declared loss
   (``_declared_part``) or from the model's own ``train_step`` (``_own_part``); the
   cutting and weighting are the same for both.
2. The update (``_apply``): each loss's gradients summed over a strategy's replicas
   (one all-reduce), clipped to their global norm, split by optimizer unit
   (``optimizer_groups.Plan``), and applied once per unit.

``train_loop(iterator, n)`` runs ``n`` steps in one ``tf.function`` call (``_steps``),
so that per-call overhead is paid once per block of steps, not once per step; the
Python loop in ``training.py`` picks ``n``. How each step gets its batch, and how a
block is compiled, is ``feeding.py``'s; evaluation's and prediction's steps are
``eval_step.py``'s. How the loss is counted (per example, per token) is asked of
``trace.accounting`` (``accounting.py``). The helpers the step calls take tensors
and give tensors: ``losses`` (how a loss is weighted and reported), ``gradients``
(norms, clipping, loss scales), ``microbatch``, ``batch_statistics``. What differs
between one device, towers and a strategy's replicas is asked of
``placement.Placement``.

AutoGraph converts the loops (``_steps``, ``EvalSteps._evaluate``, ``Blocks``')
and the model, which is called through ``model_fn.converted`` (it may branch on
tensors, and AutoGraph makes that a ``tf.cond``). Everything between, which branches
on Python values only, is marked ``tf.autograph.experimental.do_not_convert``, as
Keras marks its whole step: converting a function costs ~0.02-0.4 s of source parsing
in each process, and a command trains and evaluates the digits MLP after 6 conversions
(2 of them its input pipeline's), not 19.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import tensorflow as tf

from trainer import (
    batch_statistics,
    custom_step,
    feeding,
    gradients,
    keras_step,
    layer_losses,
    microbatch,
)
from trainer.distributed.placement import Placement
from trainer.errors import UserError
from trainer.eval_step import EvalSteps
from trainer.losses import (
    batch_loss,
    batch_size_of,
    global_examples,
    reported_scalars,
    total_loss,
    with_mean_weight,
)
from trainer.metrics import EpochMetrics, MetricSums, split_metrics
from trainer.model_fn import Mode, ModelFn, converted, split_element
from trainer.optimization import WeightAverage
from trainer.optimizer_groups import Plan, Unit
from trainer.settings import Optimization
from trainer.trace import Trace


class Steps:
    """The compiled train, eval and predict functions of one model and its optimizers.

    One step function (``_step``) serves one device, towers and a strategy's
    replicas; one loop (``_steps``) runs it, fed in one of three ways
    (``trainer.feeding``): each batch read when its step needs it, read ahead onto the
    device (``prefetch_device``), or sliced from a block of batches stacked for XLA.
    Evaluation and prediction are ``eval`` (``eval_step.EvalSteps``). A model
    whose optimizers do not all update at every step (groups taking turns, variables
    frozen until a step) has one step function per phase of its ``plan``, chosen
    from the global step.

    Args:
      model_fn: the model.
      plan: its units (built Keras optimizers over their variables) and phases.
      global_step: incremented once per applied training step.
      trace: what the model's first trace found (``trainer.trace.Trace``): its
        metrics, scalars, how its loss is given; each other mode's metrics are found
        when it is traced (``take_metrics``).
      placement: where the steps run: towers over this process's devices, a
        strategy's replicas (evaluation is split over them; prediction runs on each
        worker's first device), and the device batches are prefetched to; under its
        ``settings.jit_compile`` each block of steps is one XLA computation, fed by the
        block's batches stacked (``feeding.Blocks``).
      optimization: the Estimator's ``Optimization``: each loss's gradients clipped to
        ``clip_gradient_norm``, each batch taken in ``microbatches`` slices
        (``microbatch.py``).
      ema: a WeightAverage to update after each step, or None.
    """

    def __init__(
        self,
        model_fn: ModelFn,
        plan: Plan,
        global_step: tf.Variable,
        trace: Trace,
        placement: Placement,
        optimization: Optimization = Optimization(),  # noqa: B008 (frozen)
        ema: WeightAverage | None = None,
    ):
        self.model_fn, self.plan, self.global_step = model_fn, plan, global_step
        self.placement, self.ema = placement, ema
        self.by_group = trace.by_group
        self.microbatches = optimization.microbatches
        self.microbatch_tokens = optimization.microbatch_tokens
        self.slicing = optimization.slicing  # how each batch is sliced, or None: whole
        self.clip_gradient_norm = optimization.clip_gradient_norm
        self.weights = [
            v
            for v in model_fn.trainable_variables + model_fn.non_trainable_variables
            if tf.as_dtype(v.dtype).is_floating
        ]
        self.keras_step = getattr(model_fn, "own_keras_step", False)  # trainer.keras_step
        # A Keras model's own step adds its layers' losses itself, if it does.
        self.has_regularization = bool(model_fn.regularization_losses) and not self.keras_step
        if self.slicing or placement.num_replicas > 1:
            layer_losses.say_how_cut_batches_take(layer_losses.own_adders(model_fn.layers))
        self.towers = placement.towers(model_fn)
        batch_statistics.check_synchronized(model_fn.layers, self.slicing, self.towers is not None)
        self.batch_state = batch_statistics.parts_of(model_fn)  # over slices and replicas
        self.own_step = custom_step.has_own_step(model_fn)  # ModelFn.train_step
        # How a replica takes its step, chosen once: a Keras model's own train_step
        # applies its own updates; else the framework applies the gradients of the
        # model's declared loss, or those its own ModelFn.train_step gave.
        self._replica_step = self._keras_step if self.keras_step else self._step
        self._part = self._own_part if self.own_step else self._declared_part
        self.eval = EvalSteps(model_fn, placement, self.towers, self.has_regularization)
        for mode in (Mode.TRAIN, Mode.EVAL):
            self.take_metrics(trace, mode)
        with tf.init_scope():
            # A step's loss was NaN or Inf: the block ended there, the step not counted.
            self.nonfinite = tf.Variable(False, trainable=False, name="nonfinite")
            # After the block some weight is NaN or Inf (its step is not known).
            self.nonfinite_weights = tf.Variable(False, trainable=False, name="nonfinite_weights")
            # The global norm of the gradients of each block's last step.
            self.gradient_norm = tf.Variable(float("nan"), trainable=False, name="gradient_norm")
        self.apply_fns = [placement.update_fn(u.optimizer) for u in plan.units]
        self.jit_compile = placement.settings.jit_compile
        self.feeder = feeding.Feeder(placement.prefetch_device, stacked=self.jit_compile)
        self.blocks = feeding.Blocks(
            self._steps, self._check_weights, self.nonfinite, self.feeder, self.jit_compile
        )

    @property
    def train_loop(self) -> Callable:
        """``train_loop(iterator, n)``: up to n steps in one compiled call (``feeding.Blocks``)."""
        return self.blocks.run

    def take_metrics(self, trace: Trace, mode: Mode | None = None) -> None:
        """What a trace of the model found, for ``mode``'s steps (the trace's own by default).

        Its metric names are summed, its streamed metrics updated (in TRAIN, copies
        that the callbacks' epochs read, ``EpochMetrics``), its scalars averaged as the
        loss is, and its loss counted as the trace found (``trace.accounting``: per
        example, per token). ``by_group`` holds once any trace showed it (one with
        labels showed ``Spec.loss`` a dict of one loss per group: a model first built
        to predict has no loss to show it). Called before that mode's step is first
        traced: a traced step keeps what it was traced with.
        """
        mode = trace.mode if mode is None else mode
        streamed, counting = trace.streamed_in(mode), trace.accounting
        self.by_group = self.by_group or trace.by_group
        self.one_scale = gradients.one_scale_per_loss(self.plan, self.by_group)
        if self.one_scale and self.placement.strategy is not None:
            names_ = ", ".join(u.name for units in self.one_scale.values() for u in units)
            raise UserError(
                f"mixed_float16 with one loss over several optimizers ({names_}) keeps one loss "
                "scale for them in one process only: under a tf.distribute strategy use "
                "mixed_bfloat16 (no loss scale), or one optimizer without per-variable rules"
            )
        names, per_batch = counting.names(trace.metrics, trace.scalars, mode == Mode.TRAIN)
        per_batch += ["regularization_loss"] if self.has_regularization else []
        if mode == Mode.TRAIN:
            self.train_accounting = counting
            self.train_metrics = MetricSums(names, per_batch, self.placement.per_replica)
            self.epoch_metrics = EpochMetrics(streamed)
        else:
            per_replica = self.placement.per_replica
            self.eval.take(MetricSums(names, per_batch, per_replica, streamed), counting)

    # ------------------------------------------------------------ the step

    @tf.autograph.experimental.do_not_convert
    def _step(self, features, labels, last_of_block: tf.Tensor, phase: Sequence[int]):
        """One replica's training step: ``(finite, gradient norm)``.

        ``phase``: the units to update (``optimizer_groups.Plan.phases``).

        The update is applied either way: a branch around it keeps XLA from fusing
        it into the step and costs a small model ~15% of its speed. The loop ends the
        block at a non-finite loss, before anything is saved, and the global step does
        not count that step. The gradients are not checked each step (a pass over all
        of them costs the MLP another ~15% under XLA on CPU): a NaN or Inf gradient
        leaves NaN or Inf weights for good, and the loop checks the weights once per
        block (``_check_weights``). For the same reason the gradient norm is measured
        at the block's last step (at every step when clipping needs it; NaN otherwise).
        """
        # Batch norm whose weights wait for frozen_until_step runs as Keras runs a
        # frozen layer: normalised by its moving statistics, which stay as they are.
        frozen = batch_statistics.frozen_norms(self.model_fn.layers, self.plan.frozen(phase))
        with batch_statistics.inference_mode(frozen):
            finite, grads = self._gradients(features, labels, phase)
        norm = self._apply(grads, phase, last_of_block)
        return self.placement.all_finite(finite), norm

    @tf.autograph.experimental.do_not_convert
    def _keras_step(self, features, labels, last_of_block: tf.Tensor, phase: Sequence[int]):
        """One replica's call of a Keras model's own ``train_step`` (``trainer.keras_step``).

        It applies its own updates; its logs go to ``train_metrics`` as per-batch values.
        No gradient norm is measured: the step keeps its gradients to itself.
        """
        del last_of_block, phase  # one phase: a Keras model has no optimizer groups
        spec = keras_step.run(self.model_fn.model, features, labels)
        scalars = {"loss": spec.loss, **spec.scalars, **self.train_accounting.padding(features)}
        self.train_metrics.update({}, scalars, batch_size_of(features))
        finite = tf.reduce_all([tf.math.is_finite(value) for value in scalars.values()])
        return self.placement.all_finite(finite), tf.constant(float("nan"))

    @tf.autograph.experimental.do_not_convert
    def _gradients(self, features, labels, phase: Sequence[int]):
        """``(finite, gradients)`` of the batch's mean loss; its metrics go to ``train_metrics``.

        The gradients are arranged as ``_wanted(phase)`` lists the variables. However
        the batch is cut (towers, a strategy's replicas, micro-batches) they are the
        whole global batch's: each part is weighted by its share of it.
        """
        batch = batch_size_of(features)
        labels = with_mean_weight(labels, self.placement.total)  # before the batch is cut
        wanted = self._wanted(phase)
        share, replicas = self.placement.replica_share(batch)  # (1.0, 1) outside a strategy
        examples = global_examples(batch, self.placement, self.towers, share)
        part = self._part(wanted, examples, phase, share, replicas)
        if self.towers is not None:
            part = functools.partial(self.towers.run, part)
        shared = self.placement.per_replica and self.batch_state.state
        start = self.batch_state.start() if shared else None
        counting = self.train_accounting
        if self.slicing is None:
            objective, scalars, metrics, grads = part(features, labels)
            self.train_metrics.update(metrics, scalars, batch)
            finite, divisor = gradients.finite(objective), counting.divisor(scalars)
        else:

            def slice_(features, labels, fraction):
                objective, scalars, metrics, grads = part(features, labels, fraction)
                self.train_metrics.update(metrics, scalars, batch_size_of(features))
                divisor = counting.divisor(scalars) * fraction
                return gradients.finite(objective), (grads, divisor)

            summed = (wanted, tf.TensorSpec([], tf.float32))  # the divisor summed as gradients are
            slices = self.microbatches
            if self.microbatch_tokens:
                slices = microbatch.slices_within(features, self.microbatch_tokens)
            finite, (grads, divisor) = microbatch.accumulate(
                slice_, features, labels, slices, summed, self.batch_state
            )
        if shared:  # each replica's statistics moved by its share: made the global batch's
            sums = self.batch_state.add(self.batch_state.zeros(), start, share)
            self.batch_state.finish(self.placement.total(sums), start)
        return finite, counting.finish(grads, divisor, self.placement.total, share)

    @tf.autograph.experimental.do_not_convert
    def _declared_part(self, wanted, examples, phase, share, replicas) -> Callable:
        """``part(features, labels, fraction)``: the model's declared loss and its gradients.

        A part (the batch, a tower's shard, a micro-batch's slice) gives
        ``(objective, scalars, per-example metrics, gradients)``. The objective is the
        loss weighted by this replica's ``share`` of the global batch, plus this
        replica's part of the regularization loss, all weighted by the micro-batch's
        ``fraction`` of the step's batch; with a loss per group, a dict of them.
        """
        counting = self.train_accounting

        def part(features, labels, fraction=1.0):
            with tf.GradientTape(persistent=isinstance(wanted, dict)) as tape:
                layers, variables = self.model_fn.layers, self.model_fn.trainable_variables
                with layer_losses.during_call(layers, variables) as added:
                    spec = converted(self.model_fn)(features, labels, Mode.TRAIN)
                given = batch_loss(spec, batch_size_of(features), examples)
                loss, counted = counting.split(given)  # counted: tokens per example, or None
                scalars = {"loss": total_loss(loss), **reported_scalars(spec, loss)}
                # In float32, as Keras computes losses: a float16 loss meets float32 penalties.
                objective = tf.nest.map_structure(
                    lambda v: tf.cast(v, tf.float32) * share * fraction, loss
                )
                added_loss = 0.0
                if self.has_regularization:  # in the loss reported, as Keras reports it
                    added_loss = scalars["regularization_loss"] = layer_losses.total(added)
                    scalars["loss"] += added_loss
                    penalty = added_loss * counting.penalty_weight(counted, share, replicas)
                    objective = tf.nest.map_structure(lambda o: o + penalty * fraction, objective)
                # Mixed float16: scaled up so that small gradients survive (else as it is).
                objective = self._scale_loss(objective, phase)
            per_example, streamed = split_metrics(spec.metrics)
            counts, values = counting.reported(given, added_loss, features)
            scalars.update(counts)
            per_example.update(values)
            self.epoch_metrics.stream(streamed)
            return (
                objective,
                scalars,
                per_example,
                gradients.tape_gradients(tape, objective, wanted),
            )

        return part

    @tf.autograph.experimental.do_not_convert
    def _own_part(self, wanted, examples, phase, share, replicas) -> Callable:
        """``part(features, labels)``: the model's own ``train_step`` and the gradients it gave.

        The step is handed one ``custom_step.GroupOptimizer`` per group active in
        ``phase``, which keeps the gradients instead of applying them; they are weighted
        by this replica's ``share`` of the global batch (towers weight their shards'
        themselves), and applied by ``_apply`` as the declared loss's are.
        """
        del replicas  # a step's own loss holds its regularization, or not
        active = custom_step.active_groups(self.plan, phase)
        name = type(self.model_fn).__name__

        def part(features, labels):
            optimizers = {
                group: custom_step.GroupOptimizer(group, variables, share)
                for group, variables in active.items()
            }
            spec = converted(self.model_fn.train_step)(features, labels, optimizers)
            custom_step.check(spec, name, self.plan.groups, optimizers)
            loss = batch_loss(spec, batch_size_of(features), examples)
            scalars = {"loss": total_loss(loss), **reported_scalars(spec, loss)}
            scalars.update(self.train_accounting.padding(features))
            if self.has_regularization:
                scalars["regularization_loss"] = tf.add_n(self.model_fn.regularization_losses)
            per_example, streamed = split_metrics(spec.metrics)
            self.epoch_metrics.stream(streamed)
            grads = custom_step.arranged([optimizers], wanted)
            return total_loss(loss), scalars, per_example, grads

        return part

    @tf.autograph.experimental.do_not_convert
    def _wanted(self, phase: Sequence[int]):
        """The variables to take gradients of: a list, or per group a dict of lists."""
        if not self.by_group:
            return [v for i in phase for v in self.plan.units[i].variables]
        wanted: dict[str, list] = {}
        for i in phase:
            unit = self.plan.units[i]
            wanted.setdefault(unit.group, []).extend(unit.variables)
        return wanted

    @tf.autograph.experimental.do_not_convert
    def _scale_loss(self, objective, phase: Sequence[int]):
        """Each loss scaled by its optimizer's loss scale (mixed float16; else as it is)."""
        if not self.by_group:
            return self._first(phase, None).optimizer.scale_loss(objective)
        return {
            group: self._first(phase, group).optimizer.scale_loss(loss)
            for group, loss in objective.items()
            if any(self.plan.units[i].group == group for i in phase)
        }

    @tf.autograph.experimental.do_not_convert
    def _apply(self, grads, phase: Sequence[int], last_of_block) -> tf.Tensor:
        """Sums and clips each loss's gradients, then applies every active unit's share.

        Returns the global norm of the gradients applied (of the summed gradient before
        clipping, unscaled): measured at every step when clipping needs it, else only
        at ``last_of_block`` (a pass over every gradient costs a small model ~15% under
        XLA), NaN at the other steps.
        """
        by_loss = grads if self.by_group else {None: grads}
        norms, summed = [], {}
        for group, loss_grads in by_loss.items():
            units = [i for i in phase if not self.by_group or self.plan.units[i].group == group]
            loss_grads = summed[group] = self._summed(loss_grads)
            owner = self._first(phase, group).optimizer  # its scale scaled the loss
            if self.clip_gradient_norm:
                clip = self.clip_gradient_norm
                loss_grads, norm = gradients.clipped(loss_grads, clip, gradients.scale_of(owner))
                norms.append(norm)
            if group in self.one_scale:  # one scale: unscaled by it, every unit skips or none
                gradients.share_scale(owner, self.one_scale[group])
                loss_grads = gradients.poisoned_unless_finite(loss_grads)
            offset = 0
            for i in units:
                count = len(self.plan.units[i].variables)
                self._apply_unit(i, loss_grads[offset : offset + count])
                offset += count
            if group in self.one_scale:  # the frozen units too, for when they thaw
                gradients.share_scale(owner, self.one_scale[group])
        if self.clip_gradient_norm:
            return gradients.root_sum_square(norms)
        return tf.cond(
            tf.convert_to_tensor(last_of_block),
            lambda: self._norm(summed, phase),
            lambda: tf.constant(float("nan")),
        )

    @tf.autograph.experimental.do_not_convert
    def _norm(self, by_loss: dict, phase: Sequence[int]) -> tf.Tensor:
        """The global norm of every loss's gradients, each unscaled by its loss scale."""
        norms = [
            gradients.global_norm(grads) / gradients.scale_of(self._first(phase, group).optimizer)
            for group, grads in by_loss.items()
        ]
        return gradients.root_sum_square(norms)

    @tf.autograph.experimental.do_not_convert
    def _summed(self, grads: list) -> list:
        """Under a strategy, every replica's gradients summed (one all-reduce); else as given."""
        present = [i for i, g in enumerate(grads) if g is not None]
        grads = list(grads)
        summed = self.placement.sum_gradients([grads[i] for i in present])
        for i, g in zip(present, summed, strict=True):
            grads[i] = g
        return grads

    @tf.autograph.experimental.do_not_convert
    def _apply_unit(self, index: int, grads: list) -> None:
        unit = self.plan.units[index]
        pairs = [(g, v) for g, v in zip(grads, unit.variables, strict=True) if g is not None]
        if pairs:
            self.apply_fns[index]([g for g, _ in pairs], [v for _, v in pairs])

    @tf.autograph.experimental.do_not_convert
    def _first(self, phase: Sequence[int], group) -> Unit:
        """The first active unit following ``group``'s loss (any unit without groups)."""
        for i in phase:
            unit = self.plan.units[i]
            if not self.by_group or unit.group == group:
                return unit
        return self.plan.units[phase[0]]

    # ------------------------------------------------------------ the loop

    def _steps(self, source, num_steps: tf.Tensor) -> None:
        """Runs up to ``num_steps`` steps; stops early, setting ``nonfinite``, on a bad one.

        ``source`` is the training iterator, or under jit_compile the block's batches
        stacked (``feeding.Blocks``). After the block, the weights are checked.
        """
        fetch, carried = self.feeder.fetching(source, num_steps)
        phases = self.plan.phases
        self.nonfinite.assign(False)
        for i in tf.range(num_steps):
            element, carried = fetch(i, carried)
            features, labels = split_element(element, Mode.TRAIN)
            last = i == num_steps - 1
            if len(phases) == 1:
                args = (features, labels, last, phases[0])
                finite, norm = self.placement.run(self._replica_step, args)
            else:

                def branch(phase, args=(features, labels, last)):
                    # Defined here, in the traced loop, so that AutoGraph converts the model.
                    return lambda: self.placement.run(self._replica_step, (*args, phase))

                index = self.plan.phase_index(self.global_step)
                finite, norm = tf.switch_case(index, [branch(phase) for phase in phases])
            if last:
                self.gradient_norm.assign(norm)
            if self.ema is not None:
                self.ema.update(first=self.global_step == 0)
            self.global_step.assign_add(tf.cast(finite, tf.int64))
            # Read after their updates: the weights, and the step count (after the loss).
            self.feeder.count_wait(carried, [*self.model_fn.trainable_variables, self.global_step])
            if not finite:
                self.nonfinite.assign(True)
                break
        if not self.jit_compile:  # under XLA, after the block (XLA reduces on one thread)
            self._check_weights()

    @tf.autograph.experimental.do_not_convert
    def _check_weights(self) -> None:
        """Sets ``nonfinite_weights`` if, after a block, any model weight is NaN or Inf."""
        finite = [tf.reduce_all(tf.math.is_finite(v)) for v in self.weights]
        self.nonfinite_weights.assign(tf.logical_not(tf.reduce_all(tf.stack(finite))))
