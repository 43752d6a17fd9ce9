"""The compiled evaluation and prediction steps of one model, over towers or replicas.

An eval batch is called in ``Mode.EVAL`` (over towers, its shards), its per-example
metrics and scalars summed into ``metrics`` (``metrics.MetricSums``), its loss counted
as the trace found (``trainer.accounting``); the loss reported includes the layers'
penalties, as Keras's does. Under a strategy each replica evaluates its share of every
batch and keeps its own sums. A prediction runs the model in ``Mode.PREDICT``, over
towers if any.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from trainer import layer_losses
from trainer.accounting import Examples
from trainer.distributed.placement import Placement
from trainer.distributed.towers import make_parallel
from trainer.feeding import own_function
from trainer.losses import (
    batch_loss,
    batch_size_of,
    global_examples,
    reported_scalars,
    total_loss,
    with_mean_weight,
)
from trainer.metrics import MetricSums, split_metrics
from trainer.model_fn import Mode, ModelFn, converted, split_element


class EvalSteps:
    """``evaluate(dataset)`` and ``predict(features)``, compiled.

    Args:
      model_fn: the model.
      placement: where the steps run; evaluation is split over a strategy's replicas.
      towers: this process's devices a batch is split over (``towers.Towers``), or None.
      regularized: the layers add penalties to the loss, reported in it.
    """

    def __init__(self, model_fn: ModelFn, placement: Placement, towers, regularized: bool):
        self.model_fn, self.placement, self.towers = model_fn, placement, towers
        self.regularized = regularized
        self.metrics: MetricSums | None = None  # once traced (Steps.take_metrics)
        self.accounting = Examples()
        self.observers: list = []  # of evaluation, once the model is traced in EVAL
        self.evaluate = own_function(self._evaluate)
        self.predict = own_function(self._predict)

    def take(self, metrics: MetricSums, accounting: Examples) -> None:
        """What a trace in EVAL found: the sums to add to, and how its loss is counted."""
        self.metrics, self.accounting = metrics, accounting

    def observe(self, observers: Sequence) -> None:
        """What else each eval batch goes to (a classifier's ``confusion.ConfusionMatrix``).

        Each has ``update(predictions, labels)`` and ``reset()``. Called, as ``take``,
        once the model was traced in EVAL and before that mode's step is; evaluation
        resets and reads them (``evaluation.evaluate``).
        """
        self.observers = list(observers)

    @tf.autograph.experimental.do_not_convert
    def _batch(self, features, labels):
        """``(loss, scalars, per-example metrics)`` of one eval batch, over towers if any."""
        examples = global_examples(batch_size_of(features), self.placement, self.towers)
        labels = with_mean_weight(labels, self.placement.total)  # before towers cut it

        def forward(features, labels):  # of a batch, or of a tower's shard of it
            layers, variables = self.model_fn.layers, self.model_fn.trainable_variables
            with layer_losses.during_call(layers, variables) as added_losses:
                spec = converted(self.model_fn)(features, labels, Mode.EVAL)
            per_example, streamed = split_metrics(spec.metrics)
            self.metrics.stream(streamed)
            for observer in self.observers:
                observer.update(spec.predictions, labels)
            given = batch_loss(spec, batch_size_of(features), examples)
            loss, _ = self.accounting.split(given)
            scalars = reported_scalars(spec, loss)
            added = 0.0
            if self.regularized:  # the loss reported is the one trained, as Keras's
                added = scalars["regularization_loss"] = layer_losses.total(added_losses)
                loss = total_loss(loss) + added
            per_example.update(self.accounting.evaluated(given, added))
            return total_loss(loss), scalars, per_example, None

        if self.towers is not None:
            loss, scalars, metrics, _ = self.towers.run(forward, features, labels, training=False)
        else:
            loss, scalars, metrics, _ = forward(features, labels)
        return loss, scalars, metrics

    def _evaluate(self, dataset) -> None:
        """Adds every batch of ``dataset`` to ``metrics``.

        Under a strategy ``dataset`` is distributed (``Placement.eval_input``): each
        replica evaluates its share of every batch, and keeps its own sums.
        """
        for element in dataset:
            self.placement.run(self._update, (element,))

    @tf.autograph.experimental.do_not_convert
    def _update(self, element) -> tf.Tensor:
        features, labels = split_element(element, Mode.EVAL)
        loss, scalars, metrics = self._batch(features, labels)
        self.metrics.update(metrics, {"loss": loss, **scalars}, batch_size_of(features))
        return tf.constant(True)

    @tf.autograph.experimental.do_not_convert
    def _predict(self, features):
        def predictions(features):
            return dict(converted(self.model_fn)(features, None, Mode.PREDICT).predictions)

        if self.towers is not None:
            return make_parallel(predictions, self.towers.devices, features=features)
        return predictions(features)
