"""The Transformer (``models/transformer/``): masks of padding, causality and packed
rows; rotary positions that see offsets; packed examples computed as if alone; layer
norms in float32 under bfloat16; generation greedy, beamed (in an export too) and sampled."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import transformer
from trainer import Mode, export


def model(positions="rotary", vocab=11, **kw):
    keras.utils.set_random_seed(0)
    stack = transformer.Transformer(width=16, depth=2, heads=2, positions=positions, max_length=16)
    return transformer.LanguageModel(vocab, stack, **kw)


def test_a_packed_rows_mask_is_block_diagonal_and_causal_within_each_example():
    bias = transformer.attention_bias(tf.constant([[1, 1, 2, 2, 2, 0]]), causal=True)[0, 0]
    allowed = (bias.numpy() == 0).astype(int)
    np.testing.assert_array_equal(
        allowed,
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 0],  # padding attends nothing (and is attended by nothing)
        ],
    )


def test_rotary_positions_make_attention_depend_on_the_offset_alone():
    rng = np.random.default_rng(0)
    q, k = (tf.constant(rng.normal(size=(1, 1, 1, 8)), tf.float32) for _ in range(2))
    scores = [
        float(
            tf.reduce_sum(
                transformer.rotated(q, tf.constant([[p + 3]]))
                * transformer.rotated(k, tf.constant([[p]]))
            )
        )
        for p in (0, 5, 11)
    ]
    np.testing.assert_allclose(scores, scores[0], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_examples_packed_in_one_row_are_computed_as_if_each_were_alone(positions):
    lm = model(positions)
    first, second = [3, 5, 7, 2], [4, 6, 1]
    alone = [
        lm.logits(tf.constant([x]), tf.ones([1, len(x)], tf.int32), tf.range(len(x))[None])
        for x in (first, second)
    ]
    packed = lm.logits(
        tf.constant([first + second + [0]]),
        tf.constant([[1] * 4 + [2] * 3 + [0]]),
        tf.constant([[0, 1, 2, 3, 0, 1, 2, 0]]),
    )
    np.testing.assert_allclose(packed[0, :4], alone[0][0], atol=1e-5)
    np.testing.assert_allclose(packed[0, 4:7], alone[1][0], atol=1e-5)


def test_under_bfloat16_the_norms_and_the_logits_stay_float32():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        lm = model()
        spec = lm(
            {"tokens": tf.constant([[3, 4, 5, 0]])},
            {"targets": tf.constant([[4, 5, 6, 0]])},
            Mode.TRAIN,
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    norms = [w for w in lm.stack.weights if "norm" in w.path]
    assert norms and all(w.dtype == "float32" for w in norms)
    assert spec.predictions["logits"].dtype == tf.float32
    assert lm.stack.blocks[0].mlp_in.compute_dtype == "bfloat16"
    assert np.isfinite(float(tf.reduce_sum(spec.loss.sums)))


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_generation_greedy_is_the_argmax_chain_and_beam_scores_at_least_as_well(
    tmp_path, positions
):
    """Generation runs each new token against a cache of keys and values; what it
    chooses is checked against the whole sequence read again at each token."""
    prompts = tf.constant([[3, 4, 5, 0], [6, 2, 0, 0]])
    predicted = model(positions, generate=3)({"tokens": prompts}, None, Mode.PREDICT)
    greedy = predicted.predictions["generated"]
    lm = model(positions)
    for row, length in ((0, 3), (1, 2)):
        sequence = prompts[row, :length].numpy().tolist()
        for _ in range(3):  # each token the argmax after the sequence so far, read whole
            logits = lm.logits(
                tf.constant([sequence]),
                tf.ones([1, len(sequence)], tf.int32),
                tf.range(len(sequence))[None],
            )
            sequence.append(int(tf.argmax(logits[0, -1])))
        assert greedy[row].numpy().tolist() == sequence[length:]

    def log_prob(row, generated):
        length = (0, 3, 2)[row + 1]
        sequence = prompts[row, :length].numpy().tolist() + generated
        logits = lm.logits(
            tf.constant([sequence]),
            tf.ones([1, len(sequence)], tf.int32),
            tf.range(len(sequence))[None],
        )
        log_probs = tf.nn.log_softmax(logits[0]).numpy()
        return sum(log_probs[length - 1 + i, t] for i, t in enumerate(generated))

    beamed = model(positions, generate=3, beam=4)({"tokens": prompts}, None, Mode.PREDICT)
    beamed = beamed.predictions
    for row in range(2):
        best = beamed["generated"][row].numpy().tolist()
        assert log_prob(row, best) == pytest.approx(float(beamed["score"][row]), abs=1e-4)
        assert log_prob(row, best) >= log_prob(row, greedy[row].numpy().tolist()) - 1e-5
    if positions != "rotary":  # the export and sampling do not depend on positions
        return
    # The export searches as predict does: the same tokens and scores, in the SavedModel.
    lm = model(positions, generate=3, beam=4)
    lm({"tokens": prompts}, None, Mode.PREDICT)  # its variables made
    spec = {"tokens": tf.TensorSpec([None, 4], tf.int32)}
    saved = tf.saved_model.load(export.save(lm, spec, str(tmp_path / "export")))
    served = saved.signatures["serving_default"](tokens=prompts)
    np.testing.assert_array_equal(served["generated"], beamed["generated"])
    np.testing.assert_allclose(served["score"], beamed["score"], atol=1e-5)
    sampled = [
        model(positions, generate=5, temperature=1.0, seed=s)(
            {"tokens": prompts}, None, Mode.PREDICT
        )
        .predictions["generated"]
        .numpy()
        for s in (1, 1, 2)
    ]
    np.testing.assert_array_equal(sampled[0], sampled[1])
    assert (sampled[0] != sampled[2]).any()
