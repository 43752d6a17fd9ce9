"""One training batch's gradients: its loss weighted over towers, replicas and micro-batches.

``of_batch(steps, features, labels, phase)`` is what a step (``step.Steps._step``)
asks for a model without its own ``train_step``: the gradients of the batch's loss with
respect to the variables of the units active in ``phase``, and whether the loss was
finite; the batch's metrics go to ``steps.train_metrics`` on the way. Whichever way the
batch is cut, the gradients are those of the whole (global) batch's mean loss:

* towers (``parallel.Towers``) split it over this process's devices, each shard's
  gradient weighted by its size;
* a strategy's replica weights its loss by its share of the global batch, so that the
  replicas' gradients sum to the global batch's;
* micro-batches (``microbatch.py``) take it in slices one after another, each weighted
  by its fraction of the batch, and sum their gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import tensorflow as tf

from trainer import layer_losses, microbatch
from trainer.losses import (
    batch_loss,
    batch_size_of,
    reported_scalars,
    total_loss,
    with_mean_weight,
)
from trainer.metrics import split_metrics
from trainer.model_fn import Mode
from trainer.parallel import tape_gradients


def of_batch(steps, features, labels, phase):
    """``(finite, gradients)`` of one batch; adds its metrics to ``steps.train_metrics``.

    The gradients are arranged as ``steps.updates.wanted(phase)`` lists the variables.
    """
    batch = batch_size_of(features)
    labels = with_mean_weight(labels, steps.placement.total)  # before the batch is cut
    wanted = steps.updates.wanted(phase)
    share, replicas = steps.placement.replica_share(batch)  # towers: (1.0, 1)
    examples = global_examples(steps, batch, share)

    def run(features, labels, fraction=1.0):
        if steps.towers is not None:
            forward = functools.partial(
                _forward, steps, examples=examples, phase=phase, fraction=fraction
            )
            objective, scalars, metrics, gradients = steps.towers.run(
                forward, features, labels, wanted
            )
        else:
            with tf.GradientTape(persistent=isinstance(wanted, dict)) as tape:
                objective, scalars, metrics = _forward(
                    steps, features, labels, examples, phase, share, replicas, fraction
                )
            gradients = tape_gradients(tape, objective, wanted)
        steps.train_metrics.update(metrics, scalars, batch_size_of(features))
        return finite(objective), gradients

    shared = steps.placement.per_replica and steps.batch_state.state
    start = steps.batch_state.start() if shared else None
    if steps.microbatches == 1:
        result = run(features, labels)
    else:
        result = microbatch.accumulate(
            run, features, labels, steps.microbatches, wanted, steps.batch_state
        )
    if shared:  # each replica's statistics moved by its share: made the global batch's
        sums = steps.batch_state.add(steps.batch_state.zeros(), start, share)
        steps.batch_state.finish(steps.placement.total(sums), start)
    return result


def global_examples(steps, batch: tf.Tensor, share=None) -> Callable[[], tf.Tensor]:
    """The examples of the step's global batch, computed only if a summed loss asks.

    Towers see the whole batch; a strategy's replica its ``share`` of it (found by an
    all-reduce when not given).
    """

    def examples() -> tf.Tensor:
        if steps.towers is not None:
            return batch
        found = share if share is not None else steps.placement.replica_share(batch)[0]
        return batch / tf.cast(found, tf.float64)

    return examples


def finite(objective) -> tf.Tensor:
    """Whether every loss of a step's objective is finite."""
    return tf.reduce_all(tf.stack([tf.math.is_finite(o) for o in tf.nest.flatten(objective)]))


def _forward(steps, features, labels, examples, phase, share=1.0, replicas=1, fraction=1.0):
    """``(objective, scalars, per-example metrics)`` of one batch, shard or replica.

    The objective is the loss weighted by this replica's ``share`` of the global batch,
    plus this replica's part of the regularization loss, all weighted by the
    micro-batch's ``fraction`` of the step's batch; with a loss per group, a dict of
    them. ``examples()`` is the step's global batch (asked by a loss summed over it).
    """
    spec, added = layer_losses.forward(steps.model_fn, features, labels, Mode.TRAIN)
    loss = batch_loss(spec, batch_size_of(features), examples)
    scalars = {"loss": total_loss(loss), **reported_scalars(spec, loss)}
    # In float32, as Keras computes losses: a float16 model's loss meets float32 penalties.
    objective = tf.nest.map_structure(lambda v: tf.cast(v, tf.float32) * share * fraction, loss)
    if steps.has_regularization:  # in the loss reported, as Keras reports it
        scalars["regularization_loss"] = layer_losses.total(added)
        scalars["loss"] += scalars["regularization_loss"]
        part = scalars["regularization_loss"] / replicas * fraction  # each group's layers'
        objective = tf.nest.map_structure(lambda loss: loss + part, objective)
    # Mixed float16: scaled up so that small gradients survive (identity otherwise).
    per_example, _ = split_metrics(spec.metrics)  # streamed ones are evaluated only
    return steps.updates.scale_loss(objective, phase), scalars, per_example
