"""A Transformer encoder-decoder: the seed's sequence-to-sequence task on attention.

The contract of ``models/seq2seq.py``'s LSTM, on ``models/transformer/``'s blocks:
``features['tokens']`` the source and ``labels['targets']`` the target (ending with
``EOS``), both padded with 0. An encoder reads the source; a decoder of blocks with
cross-attention (``Transformer(cross=True)``) learns each target token from the ones
before it and the encoder's output, with a loss per real target token
(``trainer.token_mean``). Source and target share one token embedding, which is also
the output layer, transposed.

Outside TRAIN it writes the target itself, one token at a time (``models/decoding.py``):
greedy, and with ``beam`` > 1 by beam search. Each new token runs the decoder's blocks
against a cache of the earlier tokens' keys and values (``Transformer.cached``); the
encoder's output is read by each step's cross-attention, repeated and reordered with
the hypotheses. EVAL reports ``exact_match`` and ``greedy_exact_match``, as the LSTM
does, so that the two compare on one task (``experiments/reverse_lstm.gin``'s data).
"""

from __future__ import annotations

import gin
import keras
import tensorflow as tf

from models import decoding
from models.targets import BOS, EOS, scored, teacher_forced
from models.transformer import Transformer, positions_of, segments_of
from trainer import Mode, ModelFn, Spec, errors


@gin.configurable
class EncoderDecoder(ModelFn):
    """A Transformer encoder-decoder over token ids.

    Args:
      vocab_size: token ids, padding, BOS and EOS included.
      width, depth, heads, dropout, positions: each stack's (``Transformer``).
      beam: hypotheses kept when decoding; 1 decodes greedily only.
      max_length: the longest target decoded (its EOS included).
      alpha: beam search's length normalisation.
    """

    def __init__(
        self,
        vocab_size: int = gin.REQUIRED,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        dropout: float = 0.0,
        positions: str = "rotary",
        beam: int = 4,
        max_length: int = 16,
        alpha: float = 0.0,
    ):
        super().__init__(name="encoder_decoder")
        errors.check_count("EncoderDecoder.vocab_size", vocab_size, minimum=3)
        decoding.check_settings("EncoderDecoder", beam, max_length, alpha)
        self.beam, self.max_length, self.alpha = beam, max_length, alpha
        stack = dict(width=width, depth=depth, heads=heads, dropout=dropout, positions=positions)
        self.embedding = keras.layers.Embedding(vocab_size, width, name="tokens")
        self.encoder = Transformer(**stack, name="encoder")
        self.decoder = Transformer(**stack, cross=True, name="decoder")

    def __call__(self, features, labels, mode):
        """Teacher-forced logits and a loss per target token; decoded targets outside TRAIN."""
        training = mode == Mode.TRAIN
        source = features["tokens"]
        encoded = self.encoder(
            self.embedding(source),
            segments_of({}, source),
            positions_of({}, source),
            training=training,
        )
        context = (encoded, source)
        predictions = {} if training else self._decoded(context)
        if labels is None:
            return Spec(predictions)
        targets = labels["targets"]
        before = teacher_forced(targets)
        hidden = self.decoder(
            self.embedding(before),
            segments_of({}, before),
            positions_of({}, before),
            causal=True,
            context=context,
            training=training,
        )
        return scored(self._logits(hidden), targets, predictions)

    def _logits(self, hidden: tf.Tensor) -> tf.Tensor:
        """``[..., vocab]`` float32: the hidden states against the token embedding."""
        return tf.einsum("...d,vd->...v", hidden, tf.cast(self.embedding.embeddings, tf.float32))

    def _step(self, ids, i, state):
        """One decoder step: the newest token (at column ``i``) against the cache."""
        caches, context = state
        columns = tf.fill(tf.shape(ids)[:1], i)
        newest = self.embedding(ids[:, -1:])
        hidden, caches = self.decoder.cached(newest, columns[:, None], caches, columns, context)
        return self._logits(hidden[:, 0]), (caches, context)

    def _decoded(self, context) -> dict:
        """``greedy`` and ``decoded`` (beam search's best) targets, ``[b, max_length]``."""
        rows = tf.shape(context[1])[0]
        start = tf.fill([rows], tf.constant(BOS, tf.int64))
        state = (self.decoder.empty_cache(rows, self.max_length), context)
        return decoding.targets(
            self._step, start, self.max_length, self.beam, EOS, state, self.alpha
        )
