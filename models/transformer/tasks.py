"""The task models on ``blocks.Transformer`` (gin-configurable ModelFns).

``TextClassifier`` (an encoder, the mean of its real tokens, a classification head),
``LanguageModel`` (a decoder, its head the token embedding, a loss per token, which
generates in PREDICT) and ``ViT`` (an image cut into patches, an encoder, a
classification head).
"""

from __future__ import annotations

import math

import gin
import keras
import tensorflow as tf

from models import decoding, heads, judging
from models.transformer.blocks import (
    Transformer,
    checked_ids,
    positions_of,
    segments_of,
)
from trainer import Mode, ModelFn, Spec, UserError, errors, token_mean, token_metric


@gin.configurable
class LanguageModel(ModelFn):
    """A decoder-only Transformer over token ids: a causal language model.

    Reads ``features['tokens']`` (with ``segment_ids`` and ``positions`` when packed)
    and learns ``labels['targets']``, each token's next (where ``labels['mask']``, if
    given, is not 0: a chat's assistant tokens, ``chat.input_fn``), with a loss per token
    (``trainer.token_mean``, a cross-entropy: perplexity and bits per token are
    reported beside it) and ``token_accuracy``. Its output layer is the token
    embedding, transposed. In PREDICT it continues each row's tokens by ``generate``
    new ones (``decoding``: ``beam`` > 1 searches, ``temperature`` > 0 samples).

    Args:
      vocab_size: token ids, padding (0) included.
      stack: the blocks (``Transformer``), causal.
      generate: new tokens per row in PREDICT; 0 predicts each position's logits.
      beam: hypotheses kept when generating; 1 is greedy.
      temperature: > 0 samples from the softmax at this temperature, each prompt
        seeded by ``seed`` and its own tokens (``decoding.row_keys``): the same
        text in any batch, in any order.
      eos: a token that ends a generated sequence, if any.
      seed: sampling's seed.
      bytes: its tokens are bytes (id = byte + 1, as ``--tokenizer bytes`` makes
        them): ``bits_per_byte`` is reported, and generation gives ``text`` too.
      judge: in EVAL on chats (labels with the assistant's ``mask``), each chat's
        prompt is continued by ``generate`` tokens and the texts scored by this
        ``judging.Judge`` (``PythonParses``: ``parse_share``), reported as a metric;
        None: not. Needs ``bytes``.
    """

    def __init__(
        self,
        vocab_size: int = gin.REQUIRED,
        stack: Transformer | None = None,
        generate: int = 0,
        beam: int = 1,
        temperature: float = 0.0,
        eos: int | None = None,
        seed: int = 0,
        bytes: bool = False,
        judge: judging.Judge | None = None,
    ):
        super().__init__(name="language_model")
        errors.check_count("LanguageModel.vocab_size", vocab_size, minimum=2)
        errors.check_count("LanguageModel.generate", generate, minimum=0)
        errors.check_count("LanguageModel.beam", beam)
        errors.check_number("LanguageModel.temperature", temperature, 0)
        errors.check_count("LanguageModel.eos", eos, minimum=0, optional=True)
        errors.check_count("LanguageModel.seed", seed, minimum=0)
        errors.check_flag("LanguageModel.bytes", bytes)
        if judge is not None and not (bytes and generate):
            raise UserError(
                f"LanguageModel.judge scores generated text: it needs bytes = True and "
                f"generate > 0 new tokens (bytes = {bytes}, generate = {generate})"
            )
        if beam > 1 and temperature > 0:
            raise UserError(
                f"LanguageModel.beam = {beam} searches and temperature = {temperature:g} samples: "
                "choose one (beam = 1 to sample, temperature = 0 to search)"
            )
        self.vocab_size, self.generate, self.beam = int(vocab_size), generate, beam
        self.temperature, self.eos, self.seed, self.bytes = temperature, eos, seed, bytes
        self.judge = judge
        self.stack = stack or Transformer()
        if not self.stack.rotary and generate >= self.stack.max_length:
            raise UserError(
                f"LanguageModel.generate = {generate} new tokens do not fit the "
                f"Transformer.max_length = {self.stack.max_length} positions it learns (the "
                "prompt's too): raise max_length, or generate fewer"
            )
        self.embedding = keras.layers.Embedding(self.vocab_size, self.stack.width, name="tokens")

    def logits(self, tokens, segments, positions, training=False) -> tf.Tensor:
        """``[b, n, vocab]`` float32: each position's logits of the next token."""
        hidden = self.stack(
            self.embedding(tokens), segments, positions, causal=True, training=training
        )
        table = tf.cast(self.embedding.embeddings, tf.float32)
        return tf.einsum("bnd,vd->bnv", hidden, table)

    def __call__(self, features, labels, mode):
        """The next token's logits at each position; generated tokens in PREDICT."""
        tokens = checked_ids(features["tokens"])
        segments, positions = segments_of(features, tokens), positions_of(features, tokens)
        if mode == Mode.PREDICT and self.generate:
            return Spec(self._generated(tokens, segments))
        logits = self.logits(tokens, segments, positions, training=mode == Mode.TRAIN)
        if labels is None:
            return Spec({"logits": logits})
        targets = labels["targets"]
        read = real = tf.not_equal(segments, 0)
        if "mask" in labels:  # a chat's: only the assistant's tokens are learned and counted
            real &= tf.not_equal(labels["mask"], 0)
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
        hits = tf.equal(tf.argmax(logits, -1, output_type=targets.dtype), targets)
        metrics = {"token_accuracy": token_metric(hits, real)}
        if self.bytes:  # streamed over every byte of the eval set, as the loss is
            metrics["bits_per_byte"] = token_metric(losses / math.log(2.0), real)
        if mode == Mode.EVAL and self.judge is not None and "mask" in labels:
            metrics[self.judge.name] = self._judged(tokens, segments, labels["mask"])
        loss = token_mean(losses, real, cross_entropy=True, real=read)
        return Spec({"logits": logits}, loss=loss, metrics=metrics)

    def _judged(self, tokens, segments, mask):
        """The judge's mean score of each row's chats continued from their prompts."""
        prompts, rows = judging.prompts(tokens, segments, mask)
        padded = prompts.to_tensor()
        real = tf.sequence_mask(prompts.row_lengths(), tf.shape(padded)[1], tf.int32)
        texts = bytes_text(self._generated(padded, real)["generated"])
        return judging.per_row(self.judge.scores(texts), rows, tf.shape(tokens)[0])

    def _generated(self, tokens, segments) -> dict:
        """Each row's tokens continued by ``generate`` more: ``{'generated': [b, generate]}``.

        The prompt's keys and values are computed once (``Transformer.cache``); each new
        token then runs the blocks alone against that cache (``Transformer.cached``).
        An empty prompt starts from the padding token; an empty batch gives no rows.
        """
        wider = [[0, 0], [0, tf.maximum(1 - tf.shape(tokens)[1], 0)]]  # one column at least
        tokens, segments = tf.pad(tokens, wider), tf.pad(segments, wider)
        real = tf.reduce_sum(tf.cast(tf.not_equal(segments, 0), tf.int32), axis=1)
        lengths = tf.maximum(real, 1)  # an empty prompt: its padding token is its start
        total = tf.shape(tokens)[1] + self.generate  # the prompt's columns, then the new
        caches = self.stack.cache(self.embedding(tokens), segments, positions_of({}, tokens), total)
        last = tf.gather(tokens, lengths - 1, batch_dims=1)
        table = tf.cast(self.embedding.embeddings, tf.float32)

        def step(ids, i, caches):
            copies = tf.shape(ids)[0] // tf.maximum(tf.shape(tokens)[0], 1)  # beam rows, by example
            columns = tf.repeat(lengths, copies, axis=0) + i - 1  # where ids' last one is
            newest = self.embedding(ids[:, -1:])
            hidden, caches = self.stack.cached(newest, columns[:, None], caches, columns)
            return tf.einsum("bd,vd->bv", hidden[:, 0], table), caches

        extra = {}
        if self.beam > 1:
            found, scores = decoding.beam_search(
                step, last, self.generate, self.beam, self.eos, caches
            )
            found, extra = found[:, 0], {"score": scores[:, 0]}
        else:
            keys = decoding.row_keys(tokens, self.seed)
            found = decoding.greedy(
                step, last, self.generate, self.eos, caches, self.temperature, keys
            )
        if self.bytes:
            extra["text"] = bytes_text(found)
        return {"generated": found, **extra}


BYTES = [bytes([b]) for b in range(256)]


@tf.autograph.experimental.do_not_convert
def bytes_text(ids: tf.Tensor) -> tf.Tensor:
    """``[b]`` strings of byte ids (``[b, n]``, byte + 1; 0 and anything past 256 left out)."""
    kept = tf.ragged.boolean_mask(ids, (ids > 0) & (ids <= 256))
    return tf.strings.reduce_join(tf.gather(tf.constant(BYTES), kept - 1), axis=-1)


@gin.configurable
class TextClassifier(ModelFn):
    """A Transformer encoder over token ids, the mean of its real tokens, a classifier.

    Reads ``features['tokens']`` and ``labels['label']`` (class ids);
    ``heads.classification`` makes the Spec.

    Args:
      vocab_size: token ids, padding (0) included.
      num_classes: classes.
      stack: the blocks (``Transformer``).
    """

    def __init__(
        self, vocab_size: int = gin.REQUIRED, num_classes: int = 2, stack: Transformer | None = None
    ):
        super().__init__(name="text_classifier")
        errors.check_count("TextClassifier.vocab_size", vocab_size, minimum=2)
        errors.check_count("TextClassifier.num_classes", num_classes)
        self.stack = stack or Transformer()
        self.embedding = keras.layers.Embedding(int(vocab_size), self.stack.width, name="tokens")
        self.classes = keras.layers.Dense(num_classes, name="logits", dtype="float32")

    def __call__(self, features, labels, mode):
        """The classes' logits of each example's tokens."""
        tokens = checked_ids(features["tokens"])
        segments = segments_of(features, tokens)
        hidden = self.stack(
            self.embedding(tokens),
            segments,
            positions_of(features, tokens),
            training=mode == Mode.TRAIN,
        )
        real = tf.cast(tf.not_equal(segments, 0), tf.float32)[..., None]
        pooled = tf.reduce_sum(hidden * real, 1) / tf.maximum(tf.reduce_sum(real, 1), 1.0)
        return heads.classification(self.classes(pooled), labels)


@gin.configurable
class ViT(ModelFn):
    """A Vision Transformer: the image cut into patches, each a token, then an encoder.

    Reads ``features['image']`` (``[b, h, w, c]``) and ``labels['label']``; the mean of
    the patches' outputs is classified (``heads.classification``).

    Args:
      num_classes: classes.
      patch: the side of a square patch, in pixels.
      stack: the blocks (``Transformer``, learned positions: the patches' places).
    """

    def __init__(self, num_classes: int = 10, patch: int = 2, stack: Transformer | None = None):
        super().__init__(name="vit")
        errors.check_count("ViT.num_classes", num_classes)
        errors.check_count("ViT.patch", patch)
        self.patch = patch
        self.stack = stack or Transformer(positions="learned")
        self.patches = keras.layers.Conv2D(self.stack.width, patch, strides=patch, name="patches")
        self.classes = keras.layers.Dense(num_classes, name="logits", dtype="float32")

    def __call__(self, features, labels, mode):
        """The classes' logits of each image."""
        height, width = features["image"].shape[1:3]
        if any(side is not None and side % self.patch for side in (height, width)):
            raise UserError(
                f"ViT.patch = {self.patch} does not divide the {height}x{width} images, so their "
                f"last rows or columns would be left out: choose a patch that divides both "
                f"sides, e.g. {math.gcd(height or 0, width or 0)}"
            )
        grid = self.patches(features["image"])
        shape = tf.shape(grid)
        tokens = tf.reshape(grid, [shape[0], shape[1] * shape[2], self.stack.width])
        ones = tf.ones(tf.shape(tokens)[:2], tf.int32)
        places = tf.broadcast_to(tf.range(tf.shape(tokens)[1]), tf.shape(ones))
        hidden = self.stack(tokens, ones, places, training=mode == Mode.TRAIN)
        return heads.classification(self.classes(tf.reduce_mean(hidden, axis=1)), labels)
