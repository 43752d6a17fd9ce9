"""A loss averaged over the real tokens of a step's whole batch, however it is cut.

A sequence model's loss is a mean over tokens, not over examples: padding is not a
token, and a batch of long sequences holds more of them. Cut into parts (micro-batch
slices, towers, replicas, workers), the mean of each part's token mean is not the
whole batch's token mean when the parts hold different numbers of tokens; that is
the gradient-accumulation bug of 2024's trainers (transformers#35203).

A ``Spec`` says its loss is a token mean with ``loss=trainer.token_mean(losses,
weights)``: each example's weighted sum of token losses and its tokens. Each part
gives the mean over its examples of both, weighted by its share of the examples as
every loss is; the steps add both up over the parts and replicas and divide the
gradients by the tokens' total, once, before they are applied. The division is by a
count that does not depend on the weights, so it is exact:

    d/dw [sum of losses / tokens] = (sum over parts of d/dw losses) / tokens.

What is reported (``loss`` in training and evaluation) is the token mean too: each
example's mean weighted by its tokens, streamed as any weighted metric is. A token
mean of cross-entropies (``cross_entropy=True``; a compiled Keras model's
cross-entropy says so itself) also reports ``perplexity``, its exponential, and
``bits_per_token``, the mean in bits: a byte-level model's bits per byte.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import tensorflow as tf


class TokenMean(NamedTuple):
    """A loss that is a mean over tokens: made by ``token_mean``.

    Attributes:
      sums: ``[batch]``: each example's token losses, weighted and summed.
      tokens: ``[batch]``: each example's token weights summed (its real tokens).
      cross_entropy: the losses are cross-entropies (in nats): ``perplexity`` and
        ``bits_per_token`` are reported beside the loss.
      positions: ``[batch]``: each example's positions, padding included (its
        padded length), for the padding share training reports; None: unknown.
      real: ``[batch]``: each example's real tokens, when the loss counts fewer (a
        chat's assistant tokens): what the padding share and tokens/s count; None:
        ``tokens``.
    """

    sums: tf.Tensor
    tokens: tf.Tensor
    cross_entropy: bool = False
    positions: tf.Tensor | None = None
    real: tf.Tensor | None = None

    def check(self, where: str) -> None:
        """Refuses, in one line, a token mean not of one sum and one count per example."""
        if self.sums.shape.rank != 1 or self.tokens.shape.rank != 1:
            raise ValueError(
                f"{where}: Spec.loss is a TokenMean of one sum and one count per example; "
                "make it with trainer.token_mean(per_token_losses, weights)"
            )


@tf.autograph.experimental.do_not_convert
def token_mean(
    losses: tf.Tensor,
    weights: tf.Tensor | None = None,
    cross_entropy: bool = False,
    real: tf.Tensor | None = None,
) -> TokenMean:
    """The loss of per-token ``losses`` (``[batch, length, ...]``) as a token mean.

    ``weights`` (the same shape, or one that broadcasts to it): 1 for a real token, 0
    for padding, or any weight per token; None counts every token. ``cross_entropy``:
    the losses are cross-entropies in nats, so perplexity and bits are reported too.
    ``real``: 1 for each token the model reads, when the loss weighs fewer (a chat's
    assistant tokens): the padding share and tokens/s count these; None: ``weights``.
    """
    losses = tf.convert_to_tensor(losses)
    if losses.shape.rank is not None and losses.shape.rank < 2:
        raise ValueError(
            f"token_mean takes a loss per token, [batch, length], got shape {losses.shape}"
        )
    if weights is None:
        weights = tf.ones_like(losses)
    weights = tf.broadcast_to(tf.cast(weights, losses.dtype), tf.shape(losses))
    axes = tf.range(1, tf.rank(losses))
    sums, counted = tf.reduce_sum(losses * weights, axes), tf.reduce_sum(weights, axes)
    if real is not None:
        real = tf.reduce_sum(tf.broadcast_to(tf.cast(real, losses.dtype), tf.shape(losses)), axes)
    return TokenMean(sums, counted, cross_entropy, positions_of(losses), real)


@tf.autograph.experimental.do_not_convert
def positions_of(losses: tf.Tensor) -> tf.Tensor:
    """Each example's positions (``[batch]``): its padded length, of per-token ``losses``."""
    shape = tf.shape(losses)
    return tf.fill(shape[:1], tf.cast(tf.reduce_prod(shape[1:]), losses.dtype))


@tf.autograph.experimental.do_not_convert
def token_metric(values: tf.Tensor, weights: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """A metric per token (``[batch, length]``: a hit, say) as a Spec metric.

    That is ``(each example's weighted mean, its weights' sum)``, a weighted mean the
    framework streams over the whole eval set: token accuracy over all its tokens.
    """
    values = tf.cast(values, tf.float32)
    weights = tf.broadcast_to(tf.cast(weights, tf.float32), tf.shape(values))
    axes = tf.range(1, tf.rank(values))
    total = tf.reduce_sum(weights, axes)
    return tf.math.divide_no_nan(tf.reduce_sum(values * weights, axes), total), total


@tf.autograph.experimental.do_not_convert
def split(loss):
    """``(loss, tokens)``: a part's loss and its tokens, each a mean over its examples.

    A token mean gives its example means of sums and of tokens; any other loss is
    given as it is, with None.
    """
    if not isinstance(loss, TokenMean):
        return loss, None
    return tf.reduce_mean(loss.sums), tf.reduce_mean(tf.cast(loss.tokens, loss.sums.dtype))


@tf.autograph.experimental.do_not_convert
def reported(loss: TokenMean, added: tf.Tensor | float = 0.0) -> tuple[tf.Tensor, tf.Tensor]:
    """The loss as a weighted per-example metric, each example weighted by its tokens.

    Each example's value is its token mean, plus ``added`` (the regularization).
    """
    tokens = tf.cast(loss.tokens, tf.float32)
    means = tf.math.divide_no_nan(tf.cast(loss.sums, tf.float32), tokens)
    return means + tf.cast(added, tf.float32), tokens


# A training batch's tokens counted by the loss, real tokens, positions and examples
# per row (an example, unless packed), averaged as the loss is: what its padding
# share and tokens/s are made of.
TOKENS = "tokens_per_example"  # what the steps divide the summed gradients by
REAL = "real_per_example"  # the tokens read, the loss's or more
COUNTS = (TOKENS, REAL, "positions_per_example", "examples_per_row")
SEGMENTS = "segment_ids"  # a packed batch's feature: which example of its row a token is


@tf.autograph.experimental.do_not_convert
def counts(loss: TokenMean, features=None) -> dict[str, tf.Tensor]:
    """``COUNTS`` of one part of a batch: means over its rows.

    ``features``: the part's; a packed batch's ``segment_ids`` say how many examples
    each row holds (else one).
    """
    found = {TOKENS: tf.reduce_mean(tf.cast(loss.tokens, tf.float32))}
    real = loss.tokens if loss.real is None else loss.real
    found[REAL] = tf.reduce_mean(tf.cast(real, tf.float32))
    if loss.positions is not None:
        found["positions_per_example"] = tf.reduce_mean(tf.cast(loss.positions, tf.float32))
    else:  # unknown: counted as all real
        found["positions_per_example"] = found[REAL]
    segments = features.get(SEGMENTS) if isinstance(features, dict) else None
    held = 1.0 if segments is None else tf.reduce_max(segments, axis=-1)  # [rows, length]
    found["examples_per_row"] = tf.reduce_mean(tf.cast(held, tf.float32))
    return found


def padded_ids(features_spec) -> str | None:
    """The training features' padded token ids, for a loss that does not count tokens.

    The first feature (by name; ``""``: the features themselves) of integers shaped
    ``[batch, None]``: ids whose length varies from batch to batch, padded with 0, as
    ``datasets.pipeline`` pads sequences and ``tf.data``'s ``padded_batch`` does by
    default. Its zeros are the padding share training reports; None if there is none.
    """
    named = features_spec.items() if isinstance(features_spec, dict) else [("", features_spec)]
    for name, spec in sorted(named, key=lambda item: item[0]):
        if isinstance(spec, tf.TensorSpec) and spec.dtype.is_integer:
            if spec.shape.rank == 2 and spec.shape[1] is None:
                return name
    return None


@tf.autograph.experimental.do_not_convert
def counts_of_ids(ids: tf.Tensor) -> dict[str, tf.Tensor]:
    """``COUNTS`` of a part's padded ids (``[rows, length]``, 0 pads): means over its rows."""
    rows = tf.cast(tf.shape(ids)[0], tf.float32)
    real = tf.math.divide_no_nan(tf.cast(tf.math.count_nonzero(ids), tf.float32), rows)
    return {
        TOKENS: real,
        REAL: real,
        "positions_per_example": tf.cast(tf.shape(ids)[1], tf.float32),
        "examples_per_row": tf.constant(1.0),
    }


def rates(logs: dict[str, float]) -> dict[str, float]:
    """Training logs with ``COUNTS`` turned into ``padding_share`` and ``tokens_per_sec``."""
    if TOKENS not in logs:
        return logs
    counted, positions = logs.pop(TOKENS), logs.pop("positions_per_example")
    real = logs.pop(REAL, counted)
    per_row = logs.pop("examples_per_row", 1.0) or 1.0
    logs["padding_share"] = 1.0 - real / positions if positions else 0.0
    logs["tokens_per_sec"] = real / per_row * logs.get("examples_per_sec", 0.0)
    return logs


def derived(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` of a cross-entropy's token mean, with its perplexity and bits per token.

    Both are of the loss without the regularization the loss reported includes.
    """
    if "loss" not in metrics:
        return metrics
    nats = metrics["loss"] - metrics.get("regularization_loss", 0.0)
    perplexity = math.exp(nats) if nats < 700 else float("inf")
    return metrics | {"perplexity": perplexity, "bits_per_token": nats / math.log(2)}
