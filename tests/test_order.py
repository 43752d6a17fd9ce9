"""Exact resume at scale: the index-based order, what checkpoints hold, resume by arithmetic."""

import io
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets import pipeline
from datasets.order import MIX_BLOCK, Order, pipeline_positions
from datasets.records import indexed, shards
from models.mlp import MLP
from tests.support.helpers import finish, resume_run
from trainer import (
    Estimator,
    InputParams,
    Mode,
    ModelFn,
    Spec,
    UserError,
    dataset_marks,
    monitoring,
)
from trainer.model_fn import is_positioned, num_examples
from trainer.settings import Checkpoints, Optimization


def rows(order, start, count):
    return order.rows(tf.range(start, start + count, dtype=tf.int64)).numpy()


def test_every_epoch_is_a_permutation_that_differs_by_epoch_and_seed():
    order = Order([1000], seed=0)
    epochs = rows(order, 0, 3000).reshape(3, 1000)
    for epoch in epochs:
        assert sorted(epoch) == list(range(1000))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    assert not np.array_equal(epochs[0], rows(Order([1000], seed=1), 0, 1000))
    np.testing.assert_array_equal(epochs[1], rows(Order([1000], seed=0), 1000, 1000))
    assert not np.array_equal(epochs[0], np.arange(1000))  # shuffled, not in order


def test_mixing_weights_hold_and_each_source_is_read_epoch_by_epoch():
    order = Order([300, 70], weights=[0.8, 0.2], seed=3)
    positions = tf.range(10_000, dtype=tf.int64)
    source = order.source_of(positions).numpy()
    assert abs(np.mean(source == 0) - 0.8) < 0.02
    # Within every mixing block the shares are exact.
    blocks = source[: 10 * MIX_BLOCK].reshape(10, MIX_BLOCK)
    assert set((blocks == 1).sum(axis=1)) == {200}
    # Each source is read epoch by epoch in its own stream: over 7 blocks source 1
    # draws 1400 = 20 x 70 times, each of its 70 examples (rows 300..369) 20 times;
    # over 3 blocks source 0 draws 2400 = 8 x 300 times, each example 8 times.
    drawn = order.rows(tf.range(7 * MIX_BLOCK, dtype=tf.int64)).numpy()
    ones = drawn[source[: 7 * MIX_BLOCK] == 1]
    np.testing.assert_array_equal(np.bincount(ones - 300), [20] * 70)
    zeros = drawn[: 3 * MIX_BLOCK][source[: 3 * MIX_BLOCK] == 0]
    np.testing.assert_array_equal(np.bincount(zeros), [8] * 300)


@pytest.mark.parametrize(
    ("replicas", "pipelines"), [(1, 1), (2, 1), (4, 1), (4, 2), (8, 4)], ids=str
)
def test_pipelines_and_replicas_share_each_step_exactly(replicas, pipelines):
    """Whatever the devices and workers, step t reads positions [t*G, (t+1)*G)."""
    global_batch, steps, start = 24, 5, 48
    per_replica = global_batch // replicas
    seen = []
    for pipeline_id in range(pipelines):
        params = InputParams(
            per_replica,
            global_batch,
            num_input_pipelines=pipelines,
            input_pipeline_id=pipeline_id,
            start_example=start,
        )
        count = steps * (replicas // pipelines) * per_replica
        seen.append(pipeline_positions(tf.range(count, dtype=tf.int64), params).numpy())
    seen = np.concatenate(seen)
    assert sorted(seen) == list(range(start, start + steps * global_batch))
    # And each step of each pipeline stays inside its own global step.
    local = replicas // pipelines
    for positions in np.split(seen, pipelines):
        steps_of = (positions - start) // global_batch
        np.testing.assert_array_equal(steps_of, np.repeat(np.arange(steps), local * per_replica))


def test_bad_sources_and_weights_are_one_line():
    with pytest.raises(UserError, match="training source 1 is empty"):
        Order([5, 0])
    with pytest.raises(UserError, match="3 mixing weights for 2 sources"):
        Order([5, 5], weights=[1, 1, 1])
    with pytest.raises(UserError, match="a weight below 1/1000 of their sum is never drawn"):
        Order([5, 5], weights=[1, 1e-5])
    with pytest.raises(UserError, match="arrays must share their first .* dimension"):
        pipeline.ArraySource({"x": np.zeros((3, 2)), "y": np.zeros(4)})
    params = InputParams(4, 4)
    empty = pipeline.ArraySource({"x": np.zeros((0, 2), np.float32)})
    with pytest.raises(UserError, match="training source 0 is empty"):
        pipeline.build(empty, Mode.TRAIN, params, lambda e: (e, e))


# ---------------------------------------------------------------- checkpoints


class Tiny(ModelFn):
    """A linear classifier over the mean of each image channel: a model of 40 floats."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(10)

    def __call__(self, features, labels, mode):
        pooled = tf.reduce_mean(features["image"], axis=[1, 2])
        logits = self.dense(pooled)
        if labels is None:
            return Spec({"logits": logits})
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels["label"], logits)
        )
        return Spec({"logits": logits}, loss=loss)


def cifar_shaped(count):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (count, 32, 32, 3), np.uint8)
    return pipeline.ArraySource({"image": images, "label": np.arange(count) % 10}, "cifar")


def to_float(example):
    return {"image": tf.cast(example["image"], tf.float32) / 255.0}, {"label": example["label"]}


def input_state_bytes(checkpoint):
    """Bytes of what a checkpoint holds besides model, optimizer, RNG, step and its counter."""
    reader = tf.train.load_checkpoint(checkpoint)
    state = ("model/", "optimizer/", "rng/", "step/", "save_counter/", "_CHECKPOINTABLE_OBJECT")
    return sum(
        np.asarray(reader.get_tensor(key)).nbytes
        for key, _ in tf.train.list_variables(checkpoint)
        if not key.startswith(state)
    )


@pytest.mark.slow
def test_input_state_in_a_checkpoint_stays_a_few_integers(tmp_path):
    """2,000 or 20,000 CIFAR-shaped examples: the same 16 bytes of input state."""
    sizes = {}
    for count in (2_000, 20_000):
        source = cifar_shaped(count)
        estimator = Estimator(Tiny(), str(tmp_path / str(count)), global_batch_size=32, seed=0)
        estimator.train(lambda mode, params, s=source: pipeline.build(s, mode, params, to_float), 3)
        sizes[count] = input_state_bytes(tf.train.latest_checkpoint(tmp_path / str(count)))
    assert sizes == {2_000: 16, 20_000: 16}  # input_position and input_seed, int64 each


def test_a_user_pipeline_with_a_shuffle_buffer_still_resumes_exactly(tmp_path):
    """An arbitrary tf.data pipeline keeps today's path: its iterator is checkpointed."""
    images = np.random.default_rng(0).random((200, 8, 8, 1), np.float32)

    def input_fn(mode, params):
        examples = ({"image": images}, {"label": np.arange(200) % 10})
        dataset = tf.data.Dataset.from_tensor_slices(examples)
        if mode == Mode.TRAIN:
            dataset = dataset.shuffle(150, seed=params.seed).repeat()
        return dataset.batch(params.batch_size)

    def estimator(model_dir, seed=0):
        keras.utils.set_random_seed(seed)
        return Estimator(
            MLP(hidden_units=[16]),
            str(model_dir),
            global_batch_size=16,
            seed=0,
            checkpoints=Checkpoints(every_steps=5),
            steps_per_loop=4,
        )

    assert not is_positioned(input_fn(Mode.TRAIN, InputParams(16, 16, seed=0)))
    straight = estimator(tmp_path / "straight")
    straight.train(input_fn, 14)
    estimator(tmp_path / "split").train(input_fn, 7)
    # The same global seed: tf.data derives each epoch's reshuffle from it and the op's.
    resumed = estimator(tmp_path / "split")
    resumed.train(input_fn, 14)
    for a, b in zip(
        straight.model_fn.trainable_variables, resumed.model_fn.trainable_variables, strict=True
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    keys = [key for key, _ in tf.train.list_variables(str(tmp_path / "split" / "ckpt-14"))]
    assert any(key.startswith("input/") for key in keys)  # the iterator, buffer and all


# ---------------------------------------------------------------- other device counts


@pytest.mark.slow
def test_resuming_on_other_device_counts_reads_exactly_the_same_examples(tmp_path):
    """Stopped under mirrored on 2 devices at step 6, resumed on 1, 2 or 4: every step
    reads the examples an uninterrupted one-device run reads (see resume_runs.py)."""
    first = [resume_run(tmp_path / name, "mirrored:2", 6) for name in ("to1", "to2")]
    at_12, at_16 = finish(resume_run(tmp_path / "straight", "towers:1", "12,16"), stops=2)
    for process in first:
        assert finish(process)["step"] == 6
    second = [
        resume_run(tmp_path / "to1", "towers:1", 12),
        resume_run(tmp_path / "to2", "mirrored:2", 12),
    ]
    assert at_12["step"] == 12 and at_16["step"] == 16
    assert np.std(at_12["table"]) > 0.1  # the table tells steps and examples apart
    for process in second:
        assert finish(process)["table"] == at_12["table"]
    os.rename(tmp_path / "to2", tmp_path / "to4")  # from 12 steps on 2 devices to 16 on 4
    on_four = resume_run(tmp_path / "to4", "mirrored:4", 16)
    assert finish(on_four)["table"] == at_16["table"]


def test_a_large_saved_iterator_is_warned_of_naming_its_stages(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(monitoring, "INPUT_STATE_WARN_BYTES", 2**20)
    images = np.random.default_rng(0).random((2000, 16, 16, 3), np.float32)  # 6 MB

    def input_fn(mode, params):
        examples = ({"image": images}, {"label": np.arange(2000) % 10})
        dataset = tf.data.Dataset.from_tensor_slices(examples).cache()
        return dataset.shuffle(1000, seed=0).repeat().batch(params.batch_size)

    estimator = Estimator(Tiny(), str(tmp_path), global_batch_size=100, seed=0)
    with caplog.at_level("WARNING"):
        estimator.train(input_fn, 25)  # one epoch: the cache is complete
    warnings = [r.getMessage() for r in caplog.records if "saved state" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per run, not per checkpoint
    found = re.fullmatch(
        r"The training input's saved state is (\d+) MB in each checkpoint \(ckpt-25\), held "
        r"by its cache \(Dataset.cache\) and shuffle buffer \(Dataset.shuffle\): read the "
        r"data by index .*, or set Checkpoints.input = False",
        warnings[0],
    )
    assert found and int(found.group(1)) >= 6, warnings[0]  # the 6 MB cache, and the buffer


def test_rollback_on_a_positioned_input_skips_one_batch_and_keeps_its_place(tmp_path, caplog):
    """An Inf example read by step 6: the step is rolled back and its batch
    skipped; the input position counts the skipped batch, so a resumed run goes on."""
    count, batch, bad_step = 64, 4, 6
    x = np.ones((count, 1), np.float32)
    x[rows(Order([count], seed=0), 0, count)[(bad_step - 1) * batch + 1]] = np.inf
    source = pipeline.ArraySource({"x": x}, "with an inf")

    def input_fn(mode, params):
        return pipeline.build(source, mode, params, lambda e: ({"x": e["x"]}, {}))

    class Abs(ModelFn):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")

        def __call__(self, features, labels, mode):
            y = self.dense(features["x"])[:, 0]
            return Spec({"y": y}, loss=None if labels is None else tf.reduce_mean(tf.abs(y)))

    def estimator():
        return Estimator(
            Abs(),
            str(tmp_path),
            optimizer=keras.optimizers.SGD(0.001),
            global_batch_size=batch,
            steps_per_loop=1,
            checkpoints=Checkpoints(every_steps=1),
            optimization=Optimization(nonfinite_loss="rollback"),
            seed=0,
        )

    with caplog.at_level("WARNING"):
        assert estimator().train(input_fn, 12) == 12
    assert f"Skipping the batch of step {bad_step}" in caplog.text
    reader = tf.train.load_checkpoint(str(tmp_path / "ckpt-12"))
    assert reader.get_tensor("input_position/.ATTRIBUTES/VARIABLE_VALUE") == 13 * batch
    resumed = estimator()
    assert resumed.train(input_fn, 14) == 14  # epoch 0 has no second inf: no rollback
    # Every applied step moved the kernel by -lr (the gradient of |w x| is 1 for x = 1).
    assert float(resumed.model_fn.dense.kernel.numpy()[0, 0]) == pytest.approx(1 - 14 * 0.001)


def test_sources_that_cannot_be_held_or_indexed_are_one_line(tmp_path):
    import gin

    # Images of varying sizes (sequences of varying length are held ragged).
    ragged = tf.data.Dataset.range(1, 4).map(lambda n: {"x": tf.zeros([n, n])})
    gin.parse_config(["pipeline.cache = True"])
    with pytest.raises(
        UserError,
        match=r"pipeline.cache = True holds examples in memory as "
        r"arrays, but its examples vary in shape: give them one shape",
    ):
        pipeline.build(ragged, Mode.TRAIN, InputParams(2, 2), lambda e: (e, e), name="ragged")
    with pytest.raises(
        UserError,
        match="a source must be a datasets.pipeline.ArraySource, RecordExamples or a "
        "tf.data.Dataset, got list",
    ):
        pipeline.build([[1, 2, 3]], Mode.TRAIN, InputParams(2, 2), lambda e: (e, e))
    # A shard rewritten after its index was written is indexed again, not misread.
    rng = np.random.default_rng(0)
    examples = [
        {"image": rng.integers(0, 256, (4, 4, 1), np.uint8), "label": i % 10} for i in range(20)
    ]
    shards.write(examples, str(tmp_path), "train", 1, "raw", num_classes=10)
    shard = str(tmp_path / shards.shard_name("train", 0, 1, None))
    index = shard + indexed.INDEX_SUFFIX
    stale = open(index, "rb").read()
    shards.write(examples[::-1], str(tmp_path), "train", 1, "png", num_classes=10)
    with open(index, "wb") as f:
        f.write(stale)
    os.utime(index, ns=(0, 0))
    offsets = indexed.record_offsets(shard, 20)
    assert not np.array_equal(offsets, np.load(io.BytesIO(stale)))


def test_a_users_map_after_the_pipeline_keeps_its_position_and_a_filter_says_it_drops_it(
    tmp_path, caplog, monkeypatch
):
    """README's input_fn, then the user's own .map() and .prefetch(): still read by position."""
    source = cifar_shaped(64)

    def input_fn(mode, params):
        dataset = pipeline.build(source, mode, params, to_float)
        return dataset.map(
            lambda features, labels: ({"image": features["image"] * 2.0}, labels)
        ).prefetch(1)

    params = InputParams(16, 16, seed=0)
    assert is_positioned(input_fn(Mode.TRAIN, params))
    assert num_examples(input_fn(Mode.EVAL, params)) == 64  # its progress counts examples
    estimator = Estimator(Tiny(), str(tmp_path / "run"), global_batch_size=16, seed=0)
    estimator.train(input_fn, 3)
    assert input_state_bytes(tf.train.latest_checkpoint(tmp_path / "run")) == 16  # no iterator

    monkeypatch.setattr(dataset_marks, "_SAID", set())  # said once a process: this test sees it
    caplog.set_level("WARNING")
    filtered = pipeline.build(source, Mode.TRAIN, params, to_float).filter(lambda *_: True)
    assert not is_positioned(filtered)
    assert (
        "The input_fn's dataset was marked positioned, but a Filter stage after the mark "
        "drops it: training resumes it as any other input"
    ) in caplog.text
