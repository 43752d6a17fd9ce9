"""Examples that vary in length (token sequences), read by index as images are.

An in-memory source holds them as a ``tf.RaggedTensor`` (values and row splits); the
training stream's position stays the number of examples read, so resuming is exact;
each batch is padded with zeros to its longest example.
"""

import numpy as np
import pytest
import tensorflow as tf

import trainer
from datasets import pipeline
from trainer import Checkpoints, InputParams, Mode

COUNT, BATCH = 40, 4


def sequences():
    """Example i is ``i + 1`` repeated ``1 + i % 7`` times: each names itself."""
    return [[i + 1] * (1 + i % 7) for i in range(COUNT)]


def source():
    tokens = tf.ragged.constant(sequences(), dtype=tf.int64)
    return pipeline.ArraySource({"tokens": tokens, "label": np.arange(COUNT) % 2}, "text")


def input_fn(mode, params):
    def preprocess(example):
        return {"tokens": example["tokens"]}, {"label": example["label"]}

    return pipeline.build(source(), mode, params, preprocess, name="text")


def batches(mode, count, start=0, augment=False):
    params = InputParams(BATCH, BATCH, seed=3, start_example=start)
    if augment:  # each example augmented at its stream position, then batched
        dataset = pipeline.build(
            source(),
            mode,
            params,
            lambda e: ({"tokens": e["tokens"]}, {"label": e["label"]}),
            augment=lambda features, labels, seed: (features, labels),
        )
    else:
        dataset = input_fn(mode, params)
    return [(f["tokens"], y["label"]) for f, y in dataset.take(count).as_numpy_iterator()]


def examples_of(tokens):
    """The example each padded row holds, checking the row: its tokens, then zeros."""
    found = []
    for row in tokens:
        example = int(row[0]) - 1
        length = 1 + example % 7
        assert list(row[:length]) == [example + 1] * length and not row[length:].any(), row
        found.append(example)
    return found


@pytest.mark.parametrize("augment", [False, True], ids=["plain", "augmented"])
def test_varying_lengths_are_read_by_index_padded_per_batch_and_resumed_exactly(augment):
    stream = batches(Mode.TRAIN, 20, augment=augment)
    for tokens, labels in stream:
        assert tokens.shape[0] == BATCH
        assert tokens.shape[1] == max(1 + e % 7 for e in examples_of(tokens))  # its longest
        assert list(labels) == [e % 2 for e in examples_of(tokens)]
    epoch = [e for tokens, _ in stream[: COUNT // BATCH] for e in examples_of(tokens)]
    assert sorted(epoch) == list(range(COUNT)) and epoch != sorted(epoch)  # each once, shuffled
    resumed = batches(Mode.TRAIN, 7, start=13 * BATCH, augment=augment)
    for (tokens, labels), (again, again_labels) in zip(stream[13:], resumed, strict=True):
        np.testing.assert_array_equal(again, tokens)
        np.testing.assert_array_equal(again_labels, labels)


def test_evaluation_reads_each_example_of_varying_length_once_in_order():
    read = [e for tokens, _ in batches(Mode.EVAL, 100) for e in examples_of(tokens)]
    assert read == list(range(COUNT))


class BagOfTokens(trainer.ModelFn):
    """The mean of the real tokens' embeddings (zeros are padding), then a logistic unit."""

    def __init__(self):
        super().__init__()
        import keras

        self.embedding = keras.layers.Embedding(COUNT + 1, 4)
        self.out = keras.layers.Dense(1)

    def __call__(self, features, labels, mode):
        tokens = features["tokens"]
        real = tf.cast(tokens > 0, tf.float32)[..., None]
        mean = tf.reduce_sum(self.embedding(tokens) * real, 1) / tf.reduce_sum(real, 1)
        logits = self.out(mean)[:, 0]
        predictions = {"probability": tf.sigmoid(logits)}
        if mode == Mode.PREDICT:
            return trainer.Spec(predictions)
        target = tf.cast(labels["label"], tf.float32)
        loss = tf.nn.sigmoid_cross_entropy_with_logits(target, logits)
        return trainer.Spec(predictions, tf.reduce_mean(loss))


@pytest.mark.slow
def test_training_on_varying_lengths_stopped_and_resumed_ends_bitwise_as_one_run(tmp_path):
    """The 16-byte exact resume holds for text: 6 steps, then 6 more from the checkpoint,
    end with the weights 12 steps in one run reach."""

    def estimator(model_dir):
        tf.keras.utils.set_random_seed(0)
        return trainer.Estimator(
            BagOfTokens(),
            str(model_dir),
            global_batch_size=BATCH,
            seed=3,
            checkpoints=Checkpoints(every_steps=6),
            progress=False,
        )

    straight = estimator(tmp_path / "straight")
    straight.train(input_fn, 12)
    estimator(tmp_path / "stopped").train(input_fn, 6)
    resumed = estimator(tmp_path / "stopped")  # a new process's Estimator, as a rerun's
    resumed.train(input_fn, 12)
    for mine, theirs in zip(
        resumed.model_fn.trainable_variables, straight.model_fn.trainable_variables, strict=True
    ):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    assert straight.evaluate(input_fn)["loss"] == resumed.evaluate(input_fn)["loss"]


def test_a_tf_data_source_of_sequences_is_held_in_memory_ragged_and_read_by_index(caplog):
    """Examples that vary in length only, from a tf.data source: held, not read in
    sequence with a buffer (images of varying sizes still are)."""
    import logging

    caplog.set_level(logging.INFO)
    dataset = tf.data.Dataset.from_tensor_slices(tf.ragged.constant(sequences(), tf.int64))
    params = InputParams(BATCH, BATCH, seed=3)
    built = pipeline.build(dataset, Mode.TRAIN, params, lambda t: ({"tokens": t}, {}), name="d")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "Holding d-0 in memory (40 examples" in said and "in sequence" not in said
    tokens = [f["tokens"] for f, _ in built.take(COUNT // BATCH).as_numpy_iterator()]
    assert sorted(e for t in tokens for e in examples_of(t)) == list(range(COUNT))
