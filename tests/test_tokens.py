"""``trainer.token_mean``: a loss averaged over the real tokens of the whole batch, and
reported so. The gradients' exactness over slices, towers, replicas and workers is the
parity harness's ``token_mean`` row (with its negative control, ``part_token_means``)."""

import json

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

import trainer
from tests.support import parity
from tests.support.helpers import scalar_series
from trainer.settings import Checkpoints, Optimization


def token_mean_of(model, x, y) -> float:
    """The mean loss over the real tokens of ``x``, computed here in numpy."""
    logits = model(x)
    losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True).numpy()
    mask = x != 0
    return float((losses * mask).sum() / mask.sum())


def test_the_reported_loss_is_the_token_mean_of_the_whole_eval_set_and_of_training(tmp_path):
    """Eval batches of 76 and 16 tokens: the loss is over the 92 tokens, not the mean of
    the two batches' means (Keras's evaluate); training's, in 4 slices, likewise, with
    its padding share and tokens/s."""
    x, y = parity.token_arrays(32)
    x[16:, 1:] = 0  # the second batch: one token per example
    y[16:, 1:] = 0
    model = parity.tokens()
    estimator = trainer.Estimator(
        parity.TokenMeanOf(model),
        str(tmp_path),
        optimizer=keras.optimizers.SGD(0.0),  # the weights stay: the loss is known
        global_batch_size=16,
        steps_per_loop=2,
        log_every_steps=2,
        optimization=Optimization(microbatches=4),
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )

    def input_fn(mode, params):
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        return dataset.repeat() if mode == trainer.Mode.TRAIN else dataset

    logged = []

    class Logs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logged.append(logs)

    estimator.train(input_fn, 2, callbacks=[Logs()])
    whole = token_mean_of(model, x, y)
    means = [token_mean_of(model, x[i : i + 16], y[i : i + 16]) for i in (0, 16)]
    assert abs(np.mean(means) - whole) > 1e-3  # the batches' mean is not the token mean
    evaluated = estimator.evaluate(input_fn)
    assert evaluated["loss"] == pytest.approx(whole, abs=1e-6)
    assert [logs["loss"] for logs in logged] == [pytest.approx(whole, abs=1e-6)]
    # 76 + 16 real tokens of 2 x 16 x 12 positions, whatever the slices held.
    assert logged[0]["padding_share"] == pytest.approx(1 - 92 / 384, abs=1e-6)
    assert logged[0]["tokens_per_sec"] > 0 and "tokens_per_example" not in logged[0]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [line for line in lines if line["writer"] == "train"]
    assert trained[0]["padding_share"] == pytest.approx(1 - 92 / 384, abs=1e-6)
    # A cross-entropy's perplexity and bits, of the exact token mean.
    assert evaluated["perplexity"] == pytest.approx(np.exp(whole), rel=1e-6)
    assert evaluated["bits_per_token"] == pytest.approx(whole / np.log(2), rel=1e-6)


def test_a_token_metric_is_each_examples_mean_weighted_by_its_tokens():
    hits = tf.constant([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
    values, weights = trainer.token_metric(hits, tf.constant([[1, 1, 0], [1, 0, 0]]))
    np.testing.assert_allclose(values, [0.5, 0.0])
    np.testing.assert_allclose(weights, [2.0, 1.0])  # over all: 1 hit of 3 tokens


def test_a_token_mean_takes_a_loss_per_token():
    losses, weights = tf.ones([2, 3]), tf.constant([[1, 1, 0], [1, 0, 0]])
    mean = trainer.token_mean(losses * [[1.0], [4.0]], weights)
    np.testing.assert_allclose(mean.sums, [2.0, 4.0])
    np.testing.assert_allclose(mean.tokens, [2.0, 1.0])
    with pytest.raises(ValueError, match=r"token_mean takes a loss per token, \[batch, length\]"):
        trainer.token_mean(tf.ones([4]))


@pytest.mark.slow
def test_under_jit_compile_bucketed_batches_compile_once_per_bucket(tmp_path):
    """30 steps over batches of 4 lengths (buckets): XLA compiles the step at most once
    per bucket, batches are fed one at a time, and it trains as without XLA."""
    import gin

    from datasets import pipeline
    from trainer.settings import Devices

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 400)
    tokens = tf.ragged.constant([rng.integers(1, 8, n).tolist() for n in lengths], tf.int64)
    source = pipeline.ArraySource({"tokens": tokens}, "text")
    buckets = [4, 8, 16, 32]

    def input_fn(mode, params):
        def preprocess(example):  # each token's successor as its label
            return example["tokens"], example["tokens"] % 7 + 1

        return pipeline.build(source, mode, params, preprocess, name="text")

    runs = {}
    for jit in (False, True):
        gin.clear_config()
        gin.bind_parameter("lengths.buckets", buckets)
        gin.bind_parameter("lengths.group_batches", 5)
        model = parity.tokens()
        estimator = trainer.Estimator(
            parity.TokenMeanOf(model),
            str(tmp_path / f"jit={jit}"),
            optimizer=keras.optimizers.SGD(0.1),
            global_batch_size=8,
            seed=0,
            steps_per_loop=10,
            devices=Devices(jit_compile=jit),
            checkpoints=Checkpoints(every_steps=None),
            progress=False,
        )
        estimator.train(input_fn, 30)
        runs[jit] = [v.numpy() for v in model.weights]
        if jit:
            assert 2 <= estimator.model.steps.blocks.compiled_shapes <= len(buckets)
    for a, b in zip(runs[False], runs[True], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


class OwnStep(keras.Sequential):
    """A Keras model with its own train_step, as keras.io's "Customizing fit()" writes it."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("step", ["compiled", "its own train_step"])
def test_a_classifier_of_bucketed_text_reports_its_padding_share_and_tokens_per_second(
    tmp_path, step
):
    """A loss per example counts no tokens: the share is read from the padded ids' zeros
    (any integer feature [batch, None], padded with 0), over each log step's batches,
    whatever the slices or whoever takes the step; in metrics.jsonl and TensorBoard."""
    from datasets import pipeline

    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 50, rng.integers(2, 40)).tolist() for _ in range(96)]
    source = pipeline.ArraySource(
        {"tokens": tf.ragged.constant(ids, tf.int64), "label": np.arange(96) % 2}, "texts"
    )

    def input_fn(mode, params):
        def split(example):
            return {"tokens": example["tokens"]}, example["label"]

        return pipeline.build(source, mode, params, split, name="texts")

    model = (keras.Sequential if step == "compiled" else OwnStep)(
        [
            keras.Input((None,), dtype="int64", name="tokens"),
            keras.layers.Embedding(50, 8, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ],
        name="text_classifier",  # Keras's own names count up across the tests of a process
    )
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    gin.bind_parameter("lengths.buckets", [8, 16, 48])
    estimator = trainer.Estimator(
        model,
        str(tmp_path),
        global_batch_size=16,
        steps_per_loop=3,
        log_every_steps=3,
        seed=5,
        optimization=Optimization(microbatches=2 if step == "compiled" else 1),
        checkpoints=Checkpoints(every_steps=None),
        progress=False,
    )
    estimator.train(input_fn, 6)
    read = input_fn(trainer.Mode.TRAIN, trainer.InputParams(16, 16, seed=5))
    batches = [f["tokens"] for f, _ in read.take(6).as_numpy_iterator()]
    assert {b.shape[1] for b in batches} <= {8, 16, 48}
    expected = [
        1 - sum(np.count_nonzero(b) for b in part) / sum(b.size for b in part)
        for part in (batches[:3], batches[3:])
    ]
    assert 0.2 < min(expected)  # the buckets leave padding to count
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [line for line in lines if line["writer"] == "train"]
    assert [line["step"] for line in trained] == [3, 6]
    assert [line["padding_share"] for line in trained] == pytest.approx(expected, abs=1e-6)
    assert all(line["tokens_per_sec"] > 0 for line in trained)
    assert "tokens_per_example" not in trained[0]
    events = scalar_series(str(tmp_path / "train"), "padding_share")
    assert [value for _, value in events] == pytest.approx(expected, abs=1e-6)
