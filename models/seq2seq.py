"""The seed's recurrent encoder-decoder: an LSTM reads the source, another writes the target.

Token ids as ``models/targets.py`` says (0 pads, ``BOS`` 1, ``EOS`` 2); a source's
tokens are the other ids. The decoder learns each target token from the ones before
it (teacher forcing), scored as ``models/targets.py`` scores it (a loss per real
target token); in EVAL and PREDICT it writes the target itself, one token
at a time (``models/decoding.py``): greedy, and with ``beam`` > 1 by beam search,
its LSTM state reordered with the hypotheses. EVAL reports ``exact_match`` (the
decoded target equals the label, up to its ``EOS``) and ``greedy_exact_match``.
"""

from __future__ import annotations

import gin
import keras
import tensorflow as tf

from models import decoding
from models.targets import BOS, EOS, scored, teacher_forced
from trainer import Mode, ModelFn, Spec, errors


@gin.configurable
class Seq2Seq(ModelFn):
    """An LSTM encoder-decoder over token ids.

    Reads ``features['tokens']`` (the source) and ``labels['targets']`` (the target,
    ending with ``EOS``), both padded with 0.

    Args:
      vocab_size: token ids, padding, BOS and EOS included.
      width: the embeddings' and the LSTMs' width.
      dropout: on the embeddings and the decoder's outputs, in TRAIN.
      beam: hypotheses kept when decoding; 1 decodes greedily only.
      max_length: the longest target decoded (its EOS included).
      alpha: beam search's length normalisation.
    """

    def __init__(
        self,
        vocab_size: int = gin.REQUIRED,
        width: int = 128,
        dropout: float = 0.0,
        beam: int = 4,
        max_length: int = 16,
        alpha: float = 0.0,
    ):
        super().__init__(name="seq2seq")
        errors.check_count("Seq2Seq.vocab_size", vocab_size, minimum=3)
        errors.check_count("Seq2Seq.width", width)
        errors.check_number("Seq2Seq.dropout", dropout, 0, below=1)
        decoding.check_settings("Seq2Seq", beam, max_length, alpha)
        self.beam, self.max_length, self.alpha = beam, max_length, alpha
        self.source_embedding = keras.layers.Embedding(
            vocab_size, width, mask_zero=True, name="source"
        )
        self.target_embedding = keras.layers.Embedding(vocab_size, width, name="target")
        self.encoder = keras.layers.LSTM(width, return_state=True, name="encoder")
        self.decoder = keras.layers.LSTM(width, return_sequences=True, name="decoder")
        self.logits = keras.layers.Dense(vocab_size, name="logits")
        self.dropout = keras.layers.Dropout(dropout)

    def __call__(self, features, labels, mode):
        """Teacher-forced logits and a loss per target token; decoded targets outside TRAIN."""
        training = mode == Mode.TRAIN
        source = self.dropout(self.source_embedding(features["tokens"]), training=training)
        _, h, c = self.encoder(source, training=training)
        predictions = {}
        if mode != Mode.TRAIN:
            predictions = self._decoded(h, c)
        if labels is None:
            return Spec(predictions)
        targets = labels["targets"]
        inputs = self.dropout(self.target_embedding(teacher_forced(targets)), training=training)
        outputs = self.dropout(
            self.decoder(inputs, initial_state=[h, c], training=training), training=training
        )
        return scored(self.logits(outputs), targets, predictions)

    def _step(self, ids, i, state):
        """One decoder step: the last token's logits, and the LSTM's next state."""
        x = self.target_embedding(ids[:, -1])
        output, (h, c) = self.decoder.cell(x, list(state))
        return tf.cast(self.logits(output), tf.float32), (h, c)

    def _decoded(self, h, c) -> dict:
        """``greedy`` and ``decoded`` (beam search's best) targets, ``[b, max_length]``."""
        start = tf.fill(tf.shape(h)[:1], tf.constant(BOS, tf.int64))
        return decoding.targets(
            self._step, start, self.max_length, self.beam, EOS, (h, c), self.alpha
        )
