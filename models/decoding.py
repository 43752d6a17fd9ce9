"""Decoding a sequence one token at a time: greedy, sampled, or by beam search.

Each takes a ``step`` function, so it serves any model that scores a next token:

    logits, state = step(ids, i, state)

``ids`` ``[rows, i + 1]`` are each row's tokens so far (its start token first), ``i``
the step (a scalar tensor) and ``state`` whatever the model carries between steps
(an LSTM's cells; None for a Transformer that reads ``ids`` whole). ``logits`` are
``[rows, vocab]``. Beam search keeps ``beam`` rows per example and hands ``step``
``batch * beam`` rows, reordering ``state`` with its hypotheses.

All run in TensorFlow control flow (``tf.while_loop`` with buffers of a fixed
length), so they trace once and run inside a SavedModel's signature. A hypothesis
ends at ``eos`` or at ``length`` tokens; what follows its end is 0 (padding).
Greedy and sampled decoding stop once every row has ended, at most ``length`` calls
of ``step`` on ``batch`` rows (a batch of short answers costs their length); beam
search ``length`` calls on ``batch * beam`` rows, plus a top-k over ``beam * vocab``
candidates per example and step.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from trainer import errors

Step = Callable[[tf.Tensor, tf.Tensor, object], tuple[tf.Tensor, object]]
NEG_INF = -1e9  # a score no hypothesis reaches (finite: -inf - -inf would be NaN)


def check_settings(owner: str, beam, max_length, alpha) -> None:
    """Refuses a decoder's settings that mean nothing, naming ``owner``'s bindings."""
    errors.check_count(f"{owner}.beam", beam)
    errors.check_count(f"{owner}.max_length", max_length)
    errors.check_number(f"{owner}.alpha", alpha, 0)


def length_penalty(length: tf.Tensor, alpha: float) -> tf.Tensor:
    """GNMT's length normalisation, ``((5 + length) / 6) ** alpha``; 1 for alpha 0."""
    return tf.pow((5.0 + tf.cast(length, tf.float32)) / 6.0, alpha)


@tf.autograph.experimental.do_not_convert
def greedy(
    step: Step,
    start: tf.Tensor,
    length: int,
    eos: int | None = None,
    state=None,
    temperature: float = 0.0,
    keys: tf.Tensor | None = None,
) -> tf.Tensor:
    """``[batch, length]`` tokens after ``start`` (``[batch]``), each the most likely.

    With ``temperature > 0`` each is drawn from ``softmax(logits / temperature)``
    instead, each row seeded by ``(its key, step)`` (``keys`` ``[batch]`` int64, e.g.
    ``row_keys``): a row draws the same text whatever else is in its batch, in any
    order, in any process, on any device.
    """
    start = tf.cast(start, tf.int64)
    batch = tf.shape(start)[0]
    ids = tf.concat([start[:, None], tf.zeros([batch, length], tf.int64)], axis=1)
    done = tf.zeros([batch], tf.bool)

    def body(i, ids, done, given):
        logits, state = _called(step, ids[:, : i + 1], i, given)
        state = tf.nest.map_structure(_shaped, state, given)
        logits = tf.cast(logits, tf.float32)
        if temperature > 0:
            token = _sampled(logits / temperature, keys, i)
        else:
            token = tf.argmax(logits, axis=-1)
        token = tf.where(done, tf.zeros_like(token), token)
        ids = _put(ids, i + 1, token)
        if eos is not None:
            done = done | tf.equal(token, eos)
        return i + 1, ids, done, state

    loop = (tf.constant(0), ids, done, () if state is None else state)
    going = lambda i, ids, done, state: (i < length) & ~tf.reduce_all(done)  # noqa: E731
    _, ids, _, _ = tf.while_loop(going, body, loop)
    return ids[:, 1:]


def row_keys(tokens: tf.Tensor, seed: int) -> tf.Tensor:
    """``[batch]`` int64 sampling keys: each row's from ``seed`` and its tokens alone.

    Padding (0) is left out, so a prompt has its key however wide its batch is padded.
    """
    kept = tf.ragged.boolean_mask(tokens, tf.not_equal(tokens, 0))
    text = tf.strings.reduce_join(tf.strings.as_string(kept), axis=-1, separator=" ")
    return tf.strings.to_hash_bucket_fast(tf.strings.join([str(int(seed)), text], ":"), 2**62)


def _sampled(logits: tf.Tensor, keys: tf.Tensor, i: tf.Tensor) -> tf.Tensor:
    """A token drawn from each row's ``logits`` ``[batch, vocab]``, seeded by its key and ``i``."""
    seeds = tf.stack([keys, tf.fill(tf.shape(keys), tf.cast(i, tf.int64))], axis=1)

    def draw(row):
        row_logits, seed = row
        return tf.random.stateless_categorical(row_logits[None], 1, seed)[0, 0]

    return tf.map_fn(draw, (logits, seeds), fn_output_signature=tf.int64)


@tf.autograph.experimental.do_not_convert
def beam_search(
    step: Step,
    start: tf.Tensor,
    length: int,
    beam: int,
    eos: int | None = None,
    state=None,
    alpha: float = 0.0,
) -> tuple[tf.Tensor, tf.Tensor]:
    """The ``beam`` best hypotheses after ``start``: ``([batch, beam, length], [batch, beam])``.

    A hypothesis scores the sum of its tokens' log-probabilities, divided by
    ``length_penalty(its length, alpha)`` once it ends (``alpha`` 0: not normalised;
    0.6 to 1 favours longer ones). Hypotheses come best first; each step keeps the
    ``beam`` best that have not ended and the ``beam`` best that have. With a beam at
    least as wide as the hypotheses alive at any step (``vocab ** (length - 1)``) it
    is exhaustive: the best is the best of all sequences.
    """
    start = tf.cast(start, tf.int64)
    batch = tf.shape(start)[0]
    ids = tf.concat(
        [tf.tile(start[:, None, None], [1, beam, 1]), tf.zeros([batch, beam, length], tf.int64)], 2
    )
    first = tf.concat([[0.0], tf.fill([beam - 1], NEG_INF)], 0)  # one live hypothesis
    scores = tf.tile(first[None], [batch, 1])
    state = tf.nest.map_structure(
        lambda s: tf.repeat(s, beam, axis=0), () if state is None else state
    )
    ended = (tf.zeros_like(ids), tf.fill([batch, beam], NEG_INF))

    def body(i, ids, scores, ended, state):
        given = (ids, scores, ended, state)
        rows = tf.reshape(ids[:, :, : i + 1], [batch * beam, i + 1])
        logits, state = _called(step, rows, i, state)
        log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
        vocab = tf.shape(log_probs)[-1]
        totals = scores[:, :, None] + tf.reshape(log_probs, [batch, beam, vocab])
        best, index = tf.math.top_k(tf.reshape(totals, [batch, -1]), k=2 * beam)
        parent, token = index // vocab, tf.cast(index % vocab, tf.int64)
        grown = _put(tf.gather(ids, parent, batch_dims=1), i + 1, token)
        ends = tf.fill(tf.shape(token), i + 1 == length)
        if eos is not None:
            ends = ends | tf.equal(token, eos)
        # The beam best that go on, with the state of the hypothesis each grew from.
        alive, keep = tf.math.top_k(tf.where(ends, NEG_INF, best), k=beam)
        ids = tf.gather(grown, keep, batch_dims=1)
        from_row = tf.reshape(
            tf.gather(parent, keep, batch_dims=1) + beam * tf.range(batch)[:, None], [-1]
        )
        state = tf.nest.map_structure(lambda s: tf.gather(s, from_row), state)
        # The beam best that ended, so far: normalised by their length.
        normalised = tf.where(ends, best / length_penalty(i + 1, alpha), NEG_INF)
        pooled_scores = tf.concat([ended[1], normalised], axis=1)
        pooled_ids = tf.concat([ended[0], grown], axis=1)
        top, chosen = tf.math.top_k(pooled_scores, k=beam)
        ended = (tf.gather(pooled_ids, chosen, batch_dims=1), top)
        ids, alive, ended, state = tf.nest.map_structure(_shaped, (ids, alive, ended, state), given)
        return i + 1, ids, alive, ended, state

    loop = (tf.constant(0), ids, scores, ended, state)
    _, _, _, ended, _ = tf.while_loop(lambda i, *_: i < length, body, loop)
    return ended[0][:, :, 1:], ended[1]


def targets(
    step: Step, start: tf.Tensor, length: int, beam: int, eos: int, state, alpha: float = 0.0
) -> dict:
    """An encoder-decoder's targets: ``{'greedy', 'decoded'}``, ``[batch, length]`` each.

    ``decoded`` is beam search's best hypothesis, or the greedy one when ``beam`` <= 1.
    """
    first = greedy(step, start, length, eos, state)
    if beam <= 1:
        return {"greedy": first, "decoded": first}
    found, _ = beam_search(step, start, length, beam, eos, state, alpha)
    return {"greedy": first, "decoded": found[:, 0]}


def _put(ids: tf.Tensor, column: tf.Tensor, token: tf.Tensor) -> tf.Tensor:
    """``ids`` with ``token`` written at ``column`` of the last axis."""
    width = tf.shape(ids)[-1]
    at = tf.cast(tf.equal(tf.range(width), column), ids.dtype)
    return ids * (1 - at) + token[..., None] * at


def _shaped(new: tf.Tensor, old: tf.Tensor) -> tf.Tensor:
    """``new``, its static shape that of ``old`` (which a loop variable keeps)."""
    new.set_shape(old.shape)
    return new


def _called(step: Step, ids: tf.Tensor, i: tf.Tensor, state):
    """``step``'s logits and state; a state of None is carried as ``()``."""
    logits, state = step(ids, i, None if isinstance(state, tuple) and not state else state)
    return logits, () if state is None else state
