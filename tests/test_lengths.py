"""Examples that vary in length, batched by length (``datasets/lengths.py``): windows of
the training order sorted by length, and batches padded to buckets. Still read by
index: each example once an epoch, and a resume at any position is the same stream."""

import gin
import numpy as np
import pytest
import tensorflow as tf

from datasets import lengths, pipeline
from tests.support.ragged import COUNT, examples_of, long_tailed, source
from trainer import InputParams, Mode, UserError

BATCH, WINDOW = 8, 5  # ragged.COUNT (203): epochs end mid-batch and mid-window


def read(sizes, mode=Mode.TRAIN, count=60, start=0, pipelines=(0, 1), augment=None):
    params = InputParams(
        BATCH // pipelines[1],
        BATCH,
        seed=7,
        start_example=start,
        input_pipeline_id=pipelines[0],
        num_input_pipelines=pipelines[1],
    )
    dataset = pipeline.build(
        source(sizes),
        mode,
        params,
        lambda e: ({"tokens": e["tokens"]}, {"label": e["label"]}),
        augment=augment,
        name="text",
    )
    return [f["tokens"] for f, _ in dataset.take(count).as_numpy_iterator()]


def padding_share(batches):
    return np.mean([(b == 0).mean() for b in batches])


def test_grouped_windows_sort_by_length_and_keep_each_example_once_an_epoch():
    sizes = long_tailed()
    random_order = read(sizes, count=75)
    gin.bind_parameter("lengths.group_batches", WINDOW)
    grouped = read(sizes, count=75)
    stream = [e for batch in grouped for e in examples_of(batch, sizes)]
    for epoch in range(2):  # 75 batches of 8: two whole epochs of 203 and some
        read_in_it = stream[epoch * COUNT : (epoch + 1) * COUNT]
        assert sorted(read_in_it) == list(range(COUNT)), epoch
    assert stream[:COUNT] != stream[COUNT : 2 * COUNT]  # each epoch its own order
    window = WINDOW * BATCH
    first = [sizes[e] for e in stream[:window]]
    assert first == sorted(first, reverse=True)  # a window: longest first
    # The window spanning the first epoch's end sorts each epoch's part apart.
    start = COUNT // window * window
    tail, head = stream[start:COUNT], stream[COUNT : start + window]
    assert [sizes[e] for e in tail] == sorted((sizes[e] for e in tail), reverse=True)
    assert [sizes[e] for e in head] == sorted((sizes[e] for e in head), reverse=True)
    assert padding_share(grouped) < padding_share(random_order) / 2, (
        padding_share(grouped),
        padding_share(random_order),
    )


@pytest.mark.parametrize("augment", [None, lambda f, y, seed: (f, y)], ids=["batch", "example"])
def test_a_grouped_stream_resumes_at_any_position_as_the_same_stream(augment):
    sizes = long_tailed()
    gin.bind_parameter("lengths.group_batches", WINDOW)
    whole = read(sizes, count=40, augment=augment)
    for step in (3, 24, 26):  # mid-window, at the epoch's end, past it
        resumed = read(sizes, count=40 - step, start=step * BATCH, augment=augment)
        for a, b in zip(whole[step:], resumed, strict=True):
            np.testing.assert_array_equal(a, b)


def test_two_pipelines_share_out_each_grouped_batch():
    sizes = long_tailed()
    gin.bind_parameter("lengths.group_batches", WINDOW)
    whole = [examples_of(b, sizes) for b in read(sizes, count=30)]
    halves = [read(sizes, count=30, pipelines=(i, 2)) for i in range(2)]
    for step, batch in enumerate(whole):
        shares = [examples_of(halves[i][step], sizes) for i in range(2)]
        assert shares[0] + shares[1] == batch


def test_buckets_pad_each_batch_to_the_smallest_that_holds_it():
    sizes = long_tailed()
    buckets = [8, 16, 32, 64]
    gin.bind_parameter("lengths.buckets", buckets)
    for mode in (Mode.TRAIN, Mode.EVAL):
        batches = read(sizes, mode, count=30)
        for batch in batches:
            longest = max(sizes[e] for e in examples_of(batch, sizes))
            assert batch.shape[1] == min(b for b in buckets if b >= longest), mode
        assert {b.shape[1] for b in batches} <= set(buckets)


def test_the_padded_batch_of_a_source_read_one_example_at_a_time_is_bucketed_too():
    sizes = long_tailed()
    gin.bind_parameter("lengths.buckets", [16, 64])
    batches = read(sizes, count=20, augment=lambda f, y, seed: (f, y))
    assert {b.shape[1] for b in batches} <= {16, 64}
    examples_of(np.concatenate([b[:, :16] for b in batches if b.shape[1] == 16]), sizes)


@pytest.mark.parametrize(
    "binding, message",
    [
        (
            {"lengths.buckets": [64, 32]},
            "lengths.buckets must be increasing lengths > 0, got [64, 32]: list each length "
            "once, shortest first",
        ),
        (
            {"lengths.buckets": [16, 32]},
            f"{(long_tailed() > 32).sum()} examples of text are longer than the last of "
            "lengths.buckets (32; the longest has 60): add a bucket of at least that length, "
            "or cut them in preprocess",
        ),
        (
            {"lengths.group_batches": -1},
            "lengths.group_batches must be a whole number of batches >= 0, got -1",
        ),
    ],
    ids=["not_increasing", "too_long", "negative"],
)
def test_a_bad_knob_is_refused_in_one_line_before_anything_is_read(binding, message):
    for name, value in binding.items():
        gin.bind_parameter(name, value)
    with pytest.raises(UserError) as raised:
        read(long_tailed(), count=1)
    assert str(raised.value) == message


def test_knobs_for_lengths_on_a_source_of_one_shape_are_refused():
    gin.bind_parameter("lengths.group_batches", 2)
    images = pipeline.ArraySource({"x": np.zeros([20, 3], np.float32)}, "images")
    with pytest.raises(UserError, match=r"but images's are all of one shape: unbind them$"):
        pipeline.build(
            images, Mode.TRAIN, InputParams(4, 4, seed=0), lambda e: (e, {}), name="images"
        )


def test_grouping_several_mixed_sources_is_refused():
    gin.bind_parameter("lengths.group_batches", 2)
    sizes = long_tailed(40)
    with pytest.raises(UserError, match=r"groups one source by length; text mixes 2: concat"):
        pipeline.build(
            [source(sizes), source(sizes)],
            Mode.TRAIN,
            InputParams(4, 4, seed=0),
            lambda e: ({"tokens": e["tokens"]}, {}),
            name="text",
        )


def test_an_example_longer_than_every_bucket_fails_its_batch_where_lengths_change():
    """Examples not held preprocessed are checked as each batch is padded."""
    ragged = tf.ragged.constant([[1, 2, 3], [4, 5, 6, 7, 8]])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"longer than the last of"):
        lengths.padded({"tokens": ragged}, (4,))
    assert lengths.padded({"tokens": ragged}, (2, 8))["tokens"].shape == (2, 8)


def test_geometric_buckets_waste_at_most_their_ratio_and_bind_in_gin():
    buckets = lengths.geometric(8, 320)
    assert buckets[0] == 8 and buckets[-1] == 320 and len(buckets) == 25
    assert all(b % 4 == 0 for b in buckets) and buckets == sorted(set(buckets))
    # Rounded up to a multiple of 4: each at most 1.15x its neighbour, plus the rounding.
    assert all(b <= a * 1.15 + 4 for a, b in zip(buckets, buckets[1:], strict=False))
    gin.parse_config("lengths.buckets = @lengths.geometric()\nlengths.geometric.longest = 320")
    assert lengths.knobs().buckets == tuple(buckets)
