"""A target sequence learned by teacher forcing: the contract both encoder-decoders keep.

Token ids: 0 pads, ``BOS`` (1) starts the decoder, ``EOS`` (2) ends a target. The
decoder reads each target token's predecessor (``teacher_forced``) and is scored by
``scored``: a loss per real target token (``trainer.token_mean``), its accuracy, and
outside TRAIN whether the decoded targets equal the label (``exact_match``, and
``greedy_exact_match``). ``models/seq2seq.py`` (LSTMs) and
``models/encoder_decoder.py`` (Transformer blocks) differ only in how they compute the
logits, so the two compare on one task.
"""

from __future__ import annotations

import tensorflow as tf

from trainer import Spec, token_mean, token_metric

BOS, EOS = 1, 2


def teacher_forced(targets: tf.Tensor) -> tf.Tensor:
    """The decoder's inputs: each target token's predecessor, ``BOS`` first."""
    return tf.pad(targets[:, :-1], [[0, 0], [1, 0]], constant_values=BOS)


def scored(logits: tf.Tensor, targets: tf.Tensor, predictions: dict) -> Spec:
    """The Spec of teacher-forced ``logits`` against ``targets`` (0-padded).

    ``predictions``: the decoded targets (``greedy``, ``decoded``) outside TRAIN, else {}.
    """
    real = tf.not_equal(targets, 0)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=tf.cast(logits, tf.float32)
    )
    hits = tf.equal(tf.argmax(logits, -1, output_type=targets.dtype), targets)
    metrics = {"token_accuracy": token_metric(hits, real)}
    if predictions:
        metrics["exact_match"] = exact_match(predictions["decoded"], targets)
        metrics["greedy_exact_match"] = exact_match(predictions["greedy"], targets)
    return Spec(
        {"logits": logits, **predictions},
        loss=token_mean(losses, real, cross_entropy=True),
        metrics=metrics,
    )


@tf.autograph.experimental.do_not_convert
def exact_match(decoded: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
    """Per example, 1.0 when ``decoded`` equals ``targets`` up to the target's end."""
    width = tf.maximum(tf.shape(decoded)[1], tf.shape(targets)[1])
    pad = lambda t: tf.pad(tf.cast(t, tf.int64), [[0, 0], [0, width - tf.shape(t)[1]]])  # noqa: E731
    return tf.cast(tf.reduce_all(tf.equal(pad(decoded), pad(targets)), axis=1), tf.float32)
