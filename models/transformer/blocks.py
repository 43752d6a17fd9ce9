"""A Transformer's layers: masks, positions, attention, pre-norm blocks, a stack of them.

What ``models/transformer/__init__.py`` says of masks, positions and blocks; the task
models on them are in ``tasks.py``.
"""

from __future__ import annotations

import math

import gin
import keras
import tensorflow as tf

from trainer import UserError, errors

NEG = -1e9  # an attention logit that softmax makes 0 (finite: a row of padding stays finite)


@tf.autograph.experimental.do_not_convert
def segments_of(features: dict, tokens: tf.Tensor) -> tf.Tensor:
    """Each token's example in its row: ``segment_ids`` if packed, else 1, and 0 for padding."""
    if "segment_ids" in features:
        return tf.cast(features["segment_ids"], tf.int32)
    return tf.cast(tf.not_equal(tokens, 0), tf.int32)


@tf.autograph.experimental.do_not_convert
def positions_of(features: dict, tokens: tf.Tensor) -> tf.Tensor:
    """Each token's place in its example: ``positions`` if packed, else its column."""
    if "positions" in features:
        return tf.cast(features["positions"], tf.int32)
    return tf.broadcast_to(tf.range(tf.shape(tokens)[1]), tf.shape(tokens))


@tf.autograph.experimental.do_not_convert
def checked_ids(tokens: tf.Tensor) -> tf.Tensor:
    """``tokens``, once they are known to hold no negative id.

    An Embedding takes a negative id as numpy takes a negative index, from its last
    rows: a wrong input that would train without a word. An id past the last row is
    refused by the lookup itself (``errors.outside_a_table``).
    """
    smallest = tf.reduce_min(tokens) if tokens.shape.rank else tokens
    check = tf.debugging.Assert(
        smallest >= 0,
        [
            "token ids must be >= 0 (0 pads); a negative one would look up the embedding's "
            "last rows: fix the input_fn's ids; the smallest",
            smallest,
        ],
    )
    with tf.control_dependencies([check]):
        return tf.identity(tokens)


def attention_bias(segments: tf.Tensor, causal: bool) -> tf.Tensor:
    """``[batch, 1, query, key]`` float32: 0 where a query may attend a key, else ``NEG``."""
    same = tf.equal(segments[:, :, None], segments[:, None, :]) & tf.not_equal(
        segments[:, None, :], 0
    )
    if causal:
        length = tf.shape(segments)[1]
        same &= tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)[None]
    return tf.where(same, 0.0, NEG)[:, None]


def rotated(x: tf.Tensor, positions: tf.Tensor, base: float = 10_000.0) -> tf.Tensor:
    """``x`` (``[batch, length, heads, depth]``) turned by rotary position embeddings.

    Pairs of channels ``(i, i + depth/2)`` turn by ``position * base^(-2i/depth)``, so
    the dot product of a query and a key depends on their offset alone.
    """
    depth = x.shape[-1]
    half = depth // 2
    rates = tf.pow(base, -tf.range(half, dtype=tf.float32) * 2.0 / depth)
    angles = tf.cast(positions, tf.float32)[..., None, None] * rates  # [b, n, 1, half]
    cos, sin = tf.cos(angles), tf.sin(angles)
    first, second = tf.cast(x[..., :half], tf.float32), tf.cast(x[..., half:], tf.float32)
    turned = tf.concat([first * cos - second * sin, first * sin + second * cos], axis=-1)
    return tf.cast(turned, x.dtype)


class Attention(keras.layers.Layer):
    """Multi-head dot-product attention; its logits and softmax in float32.

    Args:
      width: the model's width, split into ``heads`` of ``width // heads``.
      heads: attention heads.
      dropout: on the attention weights, in TRAIN.
      rotary: turn queries and keys by their positions (``rotated``).
    """

    def __init__(self, width: int, heads: int, dropout: float = 0.0, rotary: bool = False, **kw):
        super().__init__(**kw)
        if width % heads:
            raise UserError(
                f"a width of {width} does not split into {heads} heads: make it a multiple"
            )
        self.heads, self.depth, self.rotary = heads, width // heads, rotary
        self.query, self.key, self.value, self.out = (
            keras.layers.Dense(width, name=name) for name in ("query", "key", "value", "out")
        )
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, x, bias, positions=None, context=None, training=False):
        """``x`` ``[b, n, width]`` attending to ``context`` (default ``x``) under ``bias``."""
        q, k, v = self.projected(x, positions, context)
        return self.attended(q, k, v, bias, training)

    def projected(self, x, positions=None, context=None):
        """Queries of ``x``, keys and values of ``context`` (default ``x``).

        Each ``[b, n, heads, depth]``; queries and keys turned by their positions if rotary.
        """
        context = x if context is None else context
        q, k, v = (
            self._split(f(t))
            for f, t in ((self.query, x), (self.key, context), (self.value, context))
        )
        if self.rotary:
            q, k = rotated(q, positions), rotated(k, positions)
        return q, k, v

    def attended(self, q, k, v, bias, training=False):
        """The queries' mix of the values, by their keys under ``bias``: ``[b, q, width]``."""
        logits = tf.einsum("bqhd,bkhd->bhqk", tf.cast(q, tf.float32), tf.cast(k, tf.float32))
        # Keras casts a float input to the layer's dtype: the bias is made float32 again.
        weights = tf.nn.softmax(logits / math.sqrt(self.depth) + tf.cast(bias, tf.float32), -1)
        weights = self.dropout(weights, training=training)
        mixed = tf.einsum("bhqk,bkhd->bqhd", tf.cast(weights, v.dtype), v)
        shape = tf.shape(mixed)
        return self.out(tf.reshape(mixed, [shape[0], shape[1], self.heads * self.depth]))

    def _split(self, t: tf.Tensor) -> tf.Tensor:
        shape = tf.shape(t)
        return tf.reshape(t, [shape[0], shape[1], self.heads, self.depth])


def _norm(name: str) -> keras.layers.LayerNormalization:
    """A layer norm that computes in float32 under any precision policy."""
    return keras.layers.LayerNormalization(epsilon=1e-5, dtype="float32", name=name)


class Block(keras.layers.Layer):
    """A pre-norm Transformer block: self-attention (then cross-attention), then an MLP.

    Args:
      width, heads, dropout, rotary: as ``Attention``'s.
      hidden: the MLP's width (GELU).
      cross: attend to an encoder's output too (a decoder of an encoder-decoder).
    """

    def __init__(self, width, heads, hidden, dropout=0.0, rotary=False, cross=False, **kw):
        super().__init__(**kw)
        self.attention_norm, self.mlp_norm = _norm("attention_norm"), _norm("mlp_norm")
        self.attention = Attention(width, heads, dropout, rotary, name="attention")
        self.cross = Attention(width, heads, dropout, name="cross") if cross else None
        self.cross_norm = _norm("cross_norm") if cross else None
        self.mlp_in = keras.layers.Dense(hidden, activation="gelu", name="mlp_in")
        self.mlp_out = keras.layers.Dense(width, name="mlp_out")
        self.dropout = keras.layers.Dropout(dropout)

    def call(self, x, bias, positions, context=None, context_bias=None, training=False):
        """``x`` after the block: each sublayer's output added to what it read."""
        drop = lambda t: tf.cast(self.dropout(t, training=training), x.dtype)  # noqa: E731
        x = x + drop(self.attention(self.attention_norm(x), bias, positions, training=training))
        return self._after_attention(x, context, context_bias, drop, training)

    def _after_attention(self, x, context, context_bias, drop, training=False):
        if self.cross is not None:
            h = self.cross_norm(x)
            x = x + drop(self.cross(h, context_bias, context=context, training=training))
        return x + drop(self.mlp_out(self.mlp_in(self.mlp_norm(x))))

    def keys_and_values(self, x, positions) -> tuple[tf.Tensor, tf.Tensor]:
        """Its self-attention's keys and values of ``x`` (what a cache holds)."""
        _, k, v = self.attention.projected(self.attention_norm(x), positions)
        return k, v

    def cached(self, x, bias, positions, cache, columns, context=None, context_bias=None):
        """One new token per row through the block in inference, against its cache.

        ``x`` ``[b, 1, width]``; ``cache`` ``(keys, values)`` ``[b, length, heads,
        depth]``, the token's own written at ``columns`` (``[b]``) first; ``bias``
        ``[b, 1, 1, length]``; ``context``, a decoder's encoder output. Returns ``x``
        after the block and the cache.
        """
        q, k, v = self.attention.projected(self.attention_norm(x), positions)
        at = tf.stack([tf.range(tf.shape(columns)[0]), columns], axis=-1)
        keys = tf.tensor_scatter_nd_update(cache[0], at, k[:, 0])
        values = tf.tensor_scatter_nd_update(cache[1], at, v[:, 0])
        x = x + tf.cast(self.attention.attended(q, keys, values, bias), x.dtype)
        same = lambda t: tf.cast(t, x.dtype)  # noqa: E731 (no dropout in inference)
        return self._after_attention(x, context, context_bias, same), (keys, values)


@gin.register  # a configurable made when gin calls it: @Transformer() (DESIGN.md)
class Transformer(keras.layers.Layer):
    """Blocks over embedded inputs, with positions added (learned) or turned (rotary).

    Args:
      width: the model's width.
      depth: how many blocks.
      heads: attention heads.
      hidden: the MLP's width; default 4 x width.
      dropout: on embeddings, attention weights and each sublayer's output, in TRAIN.
      positions: ``'learned'`` or ``'rotary'``.
      max_length: the longest example a learned position embedding holds.
    """

    def __init__(
        self,
        width: int = 128,
        depth: int = 2,
        heads: int = 4,
        hidden: int | None = None,
        dropout: float = 0.0,
        positions: str = "rotary",
        max_length: int = 512,
        cross: bool = False,
        **kw,
    ):
        super().__init__(**kw)
        if positions not in ("learned", "rotary"):
            raise UserError(f"positions must be 'learned' or 'rotary', got {positions!r}")
        for name, value in (("width", width), ("depth", depth), ("heads", heads)):
            errors.check_count(f"Transformer.{name}", value)
        errors.check_count("Transformer.hidden", hidden, optional=True)
        errors.check_count("Transformer.max_length", max_length)
        errors.check_number("Transformer.dropout", dropout, 0, below=1)
        errors.check_flag("Transformer.cross", cross)
        if width % heads:
            raise UserError(
                f"Transformer.width = {width} does not split into {heads} heads: make width a "
                "multiple of heads"
            )
        self.width, self.max_length, self.rotary = width, max_length, positions == "rotary"
        self.position_embedding = (
            None if self.rotary else keras.layers.Embedding(max_length, width, name="positions")
        )
        self.depth = depth
        for i in range(depth):  # attributes, not a list: a checkpoint reaches them
            block = Block(width, heads, hidden or 4 * width, dropout, self.rotary, cross)
            setattr(self, f"block_{i}", block)
        self.dropout = keras.layers.Dropout(dropout)
        self.norm = _norm("final_norm")

    @property
    def blocks(self) -> list[Block]:
        """The blocks, in order."""
        return [getattr(self, f"block_{i}") for i in range(self.depth)]

    def call(self, x, segments, positions, causal=False, context=None, training=False):
        """``[b, n, width]`` float32: ``x`` through the blocks, normalised."""
        x = self._placed(x, positions, training)
        bias = attention_bias(segments, causal)
        context, context_bias = _context(context)
        for block in self.blocks:
            x = block(x, bias, positions, context, context_bias, training=training)
        return self.norm(x)

    def _placed(self, x, positions, training=False):
        """``x`` with its learned positions added (rotary ones turn in attention)."""
        if self.position_embedding is not None:
            longest = tf.reduce_max(positions) + 1
            learned = tf.debugging.Assert(
                longest <= self.max_length,
                [
                    f"a sequence is longer than Transformer.max_length = {self.max_length}, the "
                    "positions it learns: raise max_length to the longest (and what generation "
                    "adds), or cut the examples shorter; the length",
                    longest,
                ],
            )
            with tf.control_dependencies([learned]):
                x = x + tf.cast(self.position_embedding(positions), x.dtype)
        return self.dropout(x, training=training)

    def cache(self, x, segments, positions, length: int) -> list:
        """A decoder's cache of ``x`` (``[b, n, width]``, causal): each block's keys, values.

        Each ``[b, length, heads, depth]``: those of ``x`` first, zeros after.
        """
        x, bias, found = self._placed(x, positions), attention_bias(segments, True), []
        for block in self.blocks:
            keys, values = block.keys_and_values(x, positions)
            more = [[0, 0], [0, length - tf.shape(keys)[1]], [0, 0], [0, 0]]
            found.append((tf.pad(keys, more), tf.pad(values, more)))
            x = block(x, bias, positions)
        return found

    def cached(self, x, positions, caches: list, columns, context=None) -> tuple[tf.Tensor, list]:
        """One new token per row through a decoder's blocks, against their caches.

        ``x`` is ``[b, 1, width]``, at ``columns`` ``[b]``: it attends to every column
        up to its own. Returns ``[b, 1, width]`` float32, normalised, and the caches
        with its keys and values written. Per token ``O(length)`` attention, not
        ``O(length^2)``.
        """
        x = self._placed(x, positions)
        length = tf.shape(caches[0][0])[1]
        seen = tf.range(length)[None] <= columns[:, None]
        bias = tf.where(seen, 0.0, NEG)[:, None, None]
        context, context_bias = _context(context)
        written = []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block.cached(x, bias, positions, cache, columns, context, context_bias)
            written.append(cache)
        return self.norm(x), written

    def empty_cache(self, rows, length: int) -> list:
        """A decoder's cache of ``length`` columns with nothing in it yet, for ``rows``."""
        shapes = [(b.attention.heads, b.attention.depth) for b in self.blocks]
        zeros = [
            tf.zeros([rows, length, heads, depth], self.compute_dtype) for heads, depth in shapes
        ]
        return [(z, z) for z in zeros]


def _context(context):
    """An encoder's output and its attention bias, from ``(output, its token ids)``."""
    if context is None:
        return None, None
    output, keys = context
    return output, tf.where(tf.not_equal(keys, 0), 0.0, NEG)[:, None, None]
