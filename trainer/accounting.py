"""How a step counts its loss: per example, or per token; chosen once from the Spec's loss.

The steps (``trainer/step.py``) cut a batch into parts (towers, a strategy's
replicas, micro-batches) and weight each part's loss by its share of the batch. What
that share is counted in depends on the loss the model gives:

* ``Examples``: a loss that is a mean over examples (or their sum), the default. The
  gradients of the parts, weighted by their examples, are the whole batch's.
* ``Tokens``: a ``trainer.token_mean``, a mean over the real tokens of the whole
  batch. Each part gives its sums and its tokens; the step divides the summed
  gradients by the batch's tokens once (``trainer/tokens.py`` says why).

The kind is picked once from a traced Spec's loss, by the loss's type
(``trace.KINDS``), and each mode's steps ask it, never which kind it is:

* ``names(metrics, scalars, training)``: what the mode's steps sum, per example and
  per batch;
* ``split(given)``: a part's loss and what it counts; ``penalty_weight``: the weight
  of its regularization;
* ``reported(given, added, features)``: the per-batch counts and per-example values
  a training part reports beside its loss; ``evaluated(given, added)``: the
  per-example values an evaluation part reports;
* ``divisor(scalars)`` and ``finish(grads, divisor, total, share)``: what the step's
  summed gradients are divided by, and the division;
* ``derived(metrics)`` and ``rates(logs)``: what the logs show besides the sums.

A new kind (a pair of sequences scored against a reference) is a loss type, a
subclass of ``Examples`` in a module of its own answering these, and a row of
``trace.KINDS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from trainer import gradients, tokens

Scalars = dict[str, tf.Tensor]


@dataclasses.dataclass(frozen=True)
class Examples:
    """A loss that is a mean over examples: each part weighted by its share of them.

    Attributes:
      padded: the training features' padded ids (``tokens.padded_ids``), whose zeros
        are the padding share training reports; None if there are none.
    """

    padded: str | None = None

    def names(self, metrics: Sequence[str], scalars: Sequence[str], training: bool):
        """``(per-example names, per-batch names)`` the steps of a mode sum."""
        counts = list(tokens.COUNTS) if training and self.padded is not None else []
        return list(metrics), ["loss", *scalars, *counts]

    @tf.autograph.experimental.do_not_convert
    def split(self, given):
        """``(loss, counted)``: a part's loss, and what it counts (None: its examples)."""
        return given, None

    def penalty_weight(self, counted, share, replicas: int):
        """The weight of a replica's regularization in its objective: once over the step."""
        del counted, share
        return 1.0 / replicas

    @tf.autograph.experimental.do_not_convert
    def reported(self, given, added, features) -> tuple[Scalars, Scalars]:
        """``(per-batch, per-example)`` values a training part reports beside its loss."""
        del given, added
        return self.padding(features), {}

    def evaluated(self, given, added) -> Scalars:
        """The per-example values an evaluation part reports beside its metrics."""
        del given, added
        return {}

    @tf.autograph.experimental.do_not_convert
    def padding(self, features) -> Scalars:
        """``tokens.COUNTS`` of a batch's padded ids, if it has some (else nothing)."""
        if self.padded is None:
            return {}
        return tokens.counts_of_ids(features[self.padded] if self.padded else features)

    @tf.autograph.experimental.do_not_convert
    def divisor(self, scalars: Scalars) -> tf.Tensor:
        """A part's share of what the step's summed gradients are divided by: none."""
        del scalars
        return tf.constant(0.0)

    @tf.autograph.experimental.do_not_convert
    def finish(self, grads, divisor, total: Callable, share):
        """The step's summed gradients, as they are applied: as given."""
        del divisor, total, share
        return grads

    def derived(self, metrics: dict[str, float]) -> dict[str, float]:
        """The metrics read, with what this loss adds to them: nothing."""
        return metrics

    def rates(self, logs: dict[str, float]) -> dict[str, float]:
        """Training logs with the counts turned into a padding share and tokens/s."""
        return tokens.rates(logs)


@dataclasses.dataclass(frozen=True)
class Tokens(Examples):
    """A token mean (``trainer.token_mean``): the step's gradients divided by its tokens.

    Attributes:
      padded: as ``Examples``'.
      cross_entropy: the token losses are cross-entropies: perplexity and bits per
        token are reported beside the loss.
    """

    cross_entropy: bool = False

    @classmethod
    def of(cls, loss: tokens.TokenMean, padded: str | None) -> Tokens:
        """The accounting of a Spec's token mean ``loss``."""
        return cls(padded, loss.cross_entropy)

    def names(self, metrics: Sequence[str], scalars: Sequence[str], training: bool):
        """The loss a per-example metric weighted by tokens; the counts in training."""
        counts = list(tokens.COUNTS) if training else []
        return [*metrics, "loss"], [*scalars, *counts]

    @tf.autograph.experimental.do_not_convert
    def split(self, given):
        """``(loss, tokens)``: a part's token sums and its tokens, means over its examples."""
        return tokens.split(given)

    def penalty_weight(self, counted, share, replicas: int):
        """Weighted by the part's tokens, which the step's division undoes: once over it."""
        del replicas
        return counted * share

    @tf.autograph.experimental.do_not_convert
    def reported(self, given, added, features) -> tuple[Scalars, Scalars]:
        """The part's ``tokens.COUNTS``, and each example's loss weighted by its tokens."""
        return tokens.counts(given, features), self.evaluated(given, added)

    @tf.autograph.experimental.do_not_convert
    def evaluated(self, given, added) -> Scalars:
        """Each example's token mean (plus ``added``), weighted by its tokens."""
        return {"loss": tokens.reported(given, added)}

    @tf.autograph.experimental.do_not_convert
    def divisor(self, scalars: Scalars) -> tf.Tensor:
        """A part's tokens per example (``tokens.TOKENS``), weighted as its loss is."""
        return scalars[tokens.TOKENS]

    @tf.autograph.experimental.do_not_convert
    def finish(self, grads, divisor, total: Callable, share):
        """The summed gradients divided by the step's whole batch's tokens, over replicas.

        ``total(values)`` sums over a strategy's replicas; ``share`` is this replica's
        of the global batch. Sparse gradients stay sparse.
        """
        (counted,) = total([tf.cast(divisor, tf.float32) * share])
        per_token = tf.math.divide_no_nan(1.0, counted)
        return tf.nest.map_structure(
            lambda g: None if g is None else gradients.scaled(g, per_token), grads
        )

    def derived(self, metrics: dict[str, float]) -> dict[str, float]:
        """A cross-entropy's perplexity and bits per token beside its loss."""
        return tokens.derived(metrics) if self.cross_entropy else metrics
