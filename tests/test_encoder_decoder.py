"""The Transformer encoder-decoder (``models/encoder_decoder.py``): its decoding, run
against a cache of keys and values and the encoder's output, is what reading the
whole target again gives; and on the seed's reversal task it learns to reverse."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from datasets import reversal
from models.encoder_decoder import EncoderDecoder
from models.seq2seq import Seq2Seq
from models.targets import EOS
from trainer import Mode
from trainer.settings import Checkpoints

SOURCES = tf.constant([[5, 6, 7, 0], [8, 3, 0, 0]], tf.int64)


def model(positions="rotary", **kw):
    keras.utils.set_random_seed(0)
    if positions == "lstm":  # the seed's LSTM, whose decoding shares decoding.targets
        return Seq2Seq(12, width=16, max_length=5, **kw)
    return EncoderDecoder(12, width=16, depth=2, heads=2, positions=positions, max_length=5, **kw)


def full_log_probs(made, source, target) -> np.ndarray:
    """Each target position's log-probabilities, the decoder reading the target whole."""
    features, labels = {"tokens": source[None]}, {"targets": tf.constant([target], tf.int64)}
    logits = made(features, labels, Mode.TRAIN).predictions["logits"][0]
    return tf.nn.log_softmax(logits).numpy()


@pytest.mark.parametrize("positions", ["rotary", "learned", "lstm"])
def test_decoding_against_the_cache_is_the_argmax_chain_read_whole(positions):
    """Greedy: each token the argmax after the target so far, read whole with the
    source's padding masked; beam search's best scores what reading whole scores it.
    The LSTM encoder-decoder (``models/seq2seq.py``) decodes alike, its state carried."""
    made = model(positions, beam=3)
    predictions = made({"tokens": SOURCES}, None, Mode.PREDICT).predictions
    for row in range(2):
        source = SOURCES[row, : (3, 2)[row]]  # without its padding: the same encoding
        greedy = predictions["greedy"][row].numpy().tolist()
        written = [t for t in greedy]
        if EOS in written:
            written = written[: written.index(EOS) + 1]
        log_probs = full_log_probs(made, source, written)
        assert [int(np.argmax(p)) for p in log_probs] == written
        best = predictions["decoded"][row].numpy().tolist()
        best = best[: best.index(EOS) + 1] if EOS in best else best
        scored = full_log_probs(made, source, best)
        assert (
            sum(scored[i, t] for i, t in enumerate(best))
            >= sum(log_probs[i, t] for i, t in enumerate(written)) - 1e-4
        )


@pytest.mark.slow
def test_it_learns_to_reverse_sequences(tmp_path):
    """200 steps of the reversal task, sequences of 3 to 6 of 9 ids, decoded greedily:
    exact matches far above chance (under 1/729): 0.39 here, tokens 0.82."""
    input_fn = functools.partial(
        reversal.input_fn, count=2000, eval_count=64, shortest=3, longest=6
    )
    keras.utils.set_random_seed(0)
    estimator = trainer.Estimator(
        EncoderDecoder(12, width=32, heads=2, max_length=8, beam=1),
        str(tmp_path),
        optimizer=keras.optimizers.Adam(5e-3),
        global_batch_size=32,
        seed=0,
        steps_per_loop=100,
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    estimator.train(input_fn, 200)
    metrics = estimator.evaluate(input_fn)
    assert metrics["exact_match"] >= 0.2 and metrics["token_accuracy"] >= 0.7, metrics
