"""Decoding (``models/decoding.py``): beam search against brute-force enumeration of every
sequence, with and without length normalisation, for every batch row; a state carried
and reordered with its hypotheses; greedy and seeded sampling."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from models import decoding, ops

VOCAB, LENGTH, BATCH, EOS = 5, 4, 3, 1
# The "model": logits of the next token by (batch row, step, last token).
TABLE = (np.random.default_rng(0).normal(size=(BATCH, LENGTH, VOCAB, VOCAB)) * 2).astype("f4")


def step(ids, i, state):
    """The table's logits for each row's last token; ``state`` passed on as it is."""
    rows = tf.shape(ids)[0]
    example = tf.range(rows) // (rows // BATCH)  # beam rows are their example's, in order
    at = tf.stack([example, tf.fill([rows], i), tf.cast(ids[:, -1], tf.int32)], axis=1)
    return tf.gather_nd(TABLE, at), state


def every_sequence(row: int, alpha: float) -> list[tuple[float, tuple]]:
    """Every sequence that ends (at EOS, or at LENGTH tokens), scored, best first."""
    log_probs = TABLE[row] - np.log(np.exp(TABLE[row]).sum(-1, keepdims=True))
    found = []
    for n in range(1, LENGTH + 1):
        for sequence in itertools.product(range(VOCAB), repeat=n):
            if EOS in sequence[:-1] or (n < LENGTH and sequence[-1] != EOS):
                continue
            last, score = row, 0.0  # row r starts with token r
            for i, token in enumerate(sequence):
                score, last = score + log_probs[i, last, token], token
            found.append((score / ((5 + n) / 6) ** alpha, sequence))
    return sorted(found, reverse=True)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_a_beam_wide_enough_finds_what_brute_force_finds_for_every_row(alpha):
    beam = VOCAB ** (LENGTH - 1)  # as many as the hypotheses alive at any step
    start = tf.range(BATCH, dtype=tf.int64)
    sequences, scores = ops.beam_search(step, start, LENGTH, beam, eos=EOS, alpha=alpha)
    assert sequences.shape == (BATCH, beam, LENGTH)
    for row in range(BATCH):
        best = every_sequence(row, alpha)[:10]
        np.testing.assert_allclose(scores[row, :10], [s for s, _ in best], rtol=1e-5)
        for got, (_, sequence) in zip(sequences[row, :10].numpy(), best, strict=True):
            assert got.tolist() == list(sequence) + [0] * (LENGTH - len(sequence))


def test_a_narrow_beam_traced_once_keeps_its_best_first_and_reorders_its_state():
    """The state: each hypothesis's sum of tokens, which the step reads back; a beam
    reordered wrongly would hand a hypothesis another's sum."""

    def counting(ids, i, total):
        logits, _ = step(ids, i, None)
        return logits + tf.cast(total % 2, tf.float32)[:, None], total + ids[:, -1]

    def recounting(ids, i, _):
        logits, _ = step(ids, i, None)
        return logits + tf.cast((tf.reduce_sum(ids, 1) - ids[:, 0]) % 2, tf.float32)[:, None], None

    start = tf.range(BATCH, dtype=tf.int64)
    searched = tf.function(lambda state: ops.beam_search(counting, start, LENGTH, 4, EOS, state))
    carried = searched(tf.zeros([BATCH], tf.int64))
    recomputed = ops.beam_search(recounting, start, LENGTH, 4, EOS)
    for a, b in zip(carried, recomputed, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert np.all(np.diff(carried[1].numpy(), axis=1) <= 0)  # best first


def test_greedy_takes_the_most_likely_token_and_stops_at_eos():
    start = tf.range(BATCH, dtype=tf.int64)
    greedy = decoding.greedy(step, start, LENGTH, eos=EOS).numpy()
    for row in range(BATCH):
        last, expected = row, []
        for i in range(LENGTH):
            ended = EOS in expected
            last = 0 if ended else int(TABLE[row, i, last].argmax())
            expected.append(last)
        assert greedy[row].tolist() == expected


def test_sampling_is_a_function_of_its_seed_and_its_own_prompt():
    """Each row draws from its own key (the seed and its prompt's tokens): the same text
    whatever else is in its batch, alone or in another order, padded or not."""
    prompts = tf.constant(np.arange(1, 65)[:, None], tf.int64)  # 64 one-token prompts

    def uniform(ids, i, state):
        return tf.zeros([tf.shape(ids)[0], VOCAB]), state

    def drawn(seed, rows=None, pad=0):
        chosen = prompts if rows is None else tf.gather(prompts, rows)
        chosen = tf.pad(chosen, [[0, 0], [0, pad]])
        keys = decoding.row_keys(chosen, seed)
        return decoding.greedy(uniform, chosen[:, 0], 6, temperature=1.0, keys=keys).numpy()

    first = drawn(7)
    np.testing.assert_array_equal(drawn(7), first)
    assert (first != drawn(8)).mean() > 0.5
    assert set(np.unique(first)) == set(range(VOCAB))  # every token drawn
    backwards = np.arange(64)[::-1]
    np.testing.assert_array_equal(drawn(7, backwards), first[backwards])
    np.testing.assert_array_equal(drawn(7, [5], pad=3), first[[5]])
    keys = decoding.row_keys(prompts, 7)
    traced = tf.function(
        lambda: decoding.greedy(uniform, prompts[:, 0], 6, temperature=1.0, keys=keys)
    )
    np.testing.assert_array_equal(traced(), first)
