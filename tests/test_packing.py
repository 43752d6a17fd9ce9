"""Packing (``datasets/packing.py``): short examples laid end to end in rows of one length,
with segment ids and positions, decided by index: each example once an epoch, whole and
in one row; every share of a step as many rows; a resume at any step the same stream;
and a token mean trained on packed rows as on the same examples padded."""

import json

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets import packing, pipeline
from tests.support import packed as packed_run
from tests.support import parity
from tests.support.packed import COUNT, GLOBAL, LENGTH
from trainer import InputParams, Mode, UserError


def sizes(count=COUNT, seed=0):
    return np.random.default_rng(seed).integers(1, 20, count)


def source(lengths):
    """Example i's tokens are ``i + 1`` repeated, its labels its tokens' places."""
    tokens = tf.ragged.constant([[i + 1] * int(n) for i, n in enumerate(lengths)], tf.int64)
    places = tf.ragged.constant([list(range(int(n))) for n in lengths], tf.int64)
    return pipeline.ArraySource({"tokens": tokens, "places": places}, "text")


def preprocess(example):
    return {"tokens": example["tokens"]}, {"places": example["places"]}


def read(lengths, mode=Mode.TRAIN, steps=6, start=0, pipelines=2, **knobs):
    """Each pipeline's batches of ``steps`` steps, as ``(features, labels)`` numpy."""
    gin.bind_parameter("packing.length", LENGTH)
    for name, value in knobs.items():
        gin.bind_parameter(f"packing.{name}", value)
    found = []
    for index in range(pipelines):
        params = InputParams(
            GLOBAL // pipelines, GLOBAL, seed=3, start_example=start,
            num_input_pipelines=pipelines, input_pipeline_id=index,
        )  # fmt: skip
        dataset = pipeline.build(source(lengths), mode, params, preprocess, name="text")
        found.append(list(dataset.take(steps).as_numpy_iterator()))
    return found


def unpacked(batch, lengths):
    """The examples of a packed batch, checking each: whole, in one row, in place."""
    features, labels = batch
    found = []
    for row in range(features["tokens"].shape[0]):
        segments = features["segment_ids"][row]
        for segment in range(1, segments.max() + 1):
            at = np.flatnonzero(segments == segment)
            example = int(features["tokens"][row, at[0]]) - 1
            assert len(at) == lengths[example] and np.all(np.diff(at) == 1)  # one run
            assert (features["tokens"][row, at] == example + 1).all()
            assert list(features["positions"][row, at]) == list(range(lengths[example]))
            assert list(labels["places"][row, at]) == list(range(lengths[example]))
            found.append(example)
        assert not features["tokens"][row, segments == 0].any()  # padding is zeros
    return found


def test_packed_rows_hold_each_example_once_an_epoch_whole_in_one_row():
    lengths = sizes()
    shares = read(lengths, rows_multiple=2)
    seen = []
    for step in zip(*shares, strict=True):  # each step's two shares
        rows = {batch[0]["tokens"].shape for batch in step}
        assert len(rows) == 1  # as many rows in every share of a step
        (count, length), *_ = rows
        assert length == LENGTH and count % 2 == 0
        seen += [e for batch in step for e in unpacked(batch, lengths)]
    assert sorted(seen) == list(range(COUNT))  # an epoch: each example once
    tokens = sum(b[0]["tokens"].size for share in shares for b in share)
    assert 1 - lengths.sum() / tokens < 0.35  # padded to each batch's longest: about 0.5


def test_a_packed_stream_resumes_at_any_step_as_the_same_stream():
    lengths = sizes()
    whole = read(lengths, steps=4)
    resumed = read(lengths, steps=2, start=2 * GLOBAL)
    for share, tail in zip(whole, resumed, strict=True):
        for a, b in zip(share[2:], tail, strict=True):
            tf.nest.map_structure(np.testing.assert_array_equal, a, b)


def test_eval_packs_each_batch_and_predict_gives_each_example_a_row():
    lengths = sizes()
    (evaluated,) = read(lengths, Mode.EVAL, steps=100, pipelines=1)
    assert sorted(e for b in evaluated for e in unpacked(b, lengths)) == list(range(COUNT))
    (predicted,) = read(lengths, Mode.PREDICT, steps=100, pipelines=1)
    rows = np.concatenate([b[0]["tokens"][:, 0] for b in predicted]) - 1
    assert list(rows) == list(range(COUNT))  # in order, one a row
    assert all(
        unpacked(b, lengths) == list(range(i * 16, i * 16 + 16)) for i, b in enumerate(predicted)
    )


def test_the_first_fit_places_longest_first_in_the_first_row_with_room():
    row, offset, segment, used = packing.first_fit(tf.constant([[3, 5, 2, 4]]), 7)
    # 5 -> row 0; 4 -> row 1; 3 -> row 1 (0 has 2 left); 2 -> row 0.
    np.testing.assert_array_equal(row, [[1, 0, 0, 1]])
    np.testing.assert_array_equal(offset, [[4, 0, 5, 0]])
    np.testing.assert_array_equal(segment, [[2, 1, 2, 1]])
    np.testing.assert_array_equal(used, [2])


@pytest.mark.parametrize(
    "bindings, arrays, message",
    [
        ({"packing.length": 10}, None, r"^3 examples of text are longer than a row of packing"),
        ({"packing.length": -1}, None, r"^packing.length must be a whole number >= 0, got -1"),
        (
            {"packing.length": 30, "lengths.group_batches": 5},
            None,
            r"^packing.length .* does not go with lengths.group_batches: unbind one",
        ),
        (
            {"packing.length": 30},
            {"label": np.zeros(COUNT, np.int64)},
            r"^packing lays every part of an example out along a row, but some of text's",
        ),
    ],
)
def test_what_packing_cannot_take_is_refused_in_one_line(bindings, arrays, message):
    lengths = np.minimum(sizes(), 10)
    lengths[:3] = 11  # 3 longer than a row of 10
    for key, value in bindings.items():
        gin.bind_parameter(key, value)
    data = source(lengths)
    if arrays:
        data = pipeline.ArraySource({**data.arrays, **arrays}, "text")

    def labelled(example):
        return {"tokens": example["tokens"]}, {k: example[k] for k in example if k != "tokens"}

    params = InputParams(GLOBAL, GLOBAL, seed=0)
    with pytest.raises(UserError, match=message) as refused:
        pipeline.build(data, Mode.TRAIN, params, labelled, name="text")
    assert "\n" not in str(refused.value)


def test_a_token_mean_trains_on_packed_rows_as_on_the_same_examples_padded(tmp_path):
    """The same examples each step, packed in 2 micro-batches or padded in one: the same
    weights after 3 steps; the logs' padding share is the packed rows', and tokens/s
    counts each real token once."""
    logged = []

    class Logs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logged.append(logs)

    weights = {
        packed: packed_run.trained(
            tmp_path / f"packed={packed}",
            3,
            packed,
            [Logs()] if packed else [],
            microbatches=2 if packed else 1,
        )
        for packed in (False, True)
    }
    for padded, packed in zip(weights[False], weights[True], strict=True):
        np.testing.assert_allclose(packed, padded, atol=1e-6)
    assert np.abs(weights[True][0] - parity.tokens().weights[0].numpy()).max() > 1e-2  # trained
    # Padding share and tokens/s from the packed rows read again.
    gin.bind_parameter("packing.length", LENGTH)
    params = InputParams(GLOBAL, GLOBAL, seed=0)
    batches = list(packed_run.input_fn()(Mode.TRAIN, params).take(3).as_numpy_iterator())
    real = sum((b[0]["segment_ids"] > 0).sum() for b in batches)
    share = 1 - real / sum(b[0]["tokens"].size for b in batches)
    (logs,) = logged
    assert logs["padding_share"] == pytest.approx(share, abs=1e-6)
    lines = [json.loads(line) for line in (tmp_path / "packed=True/metrics.jsonl").open()]
    (trained,) = [line for line in lines if line["writer"] == "train"]
    per_example = trained["tokens_per_sec"] / (trained["steps_per_sec"] * GLOBAL)
    assert per_example == pytest.approx(real / (3 * GLOBAL), rel=1e-5)
