"""The Estimator loop on the real digits data: steps, checkpoints, events, resume, eval."""

import functools
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets import digits
from models.mlp import MLP
from tests.support.helpers import checkpoint_steps, event_tags, scalar_series
from trainer import Estimator, Mode, UserError
from trainer.settings import Checkpoints, Devices, RunConfig


def make_estimator(model_dir, seed=0, **kwargs):
    keras.utils.set_random_seed(seed)
    options = dict(
        global_batch_size=32,
        eval_batch_size=100,
        steps_per_loop=4,
        log_every_steps=5,
        checkpoints=Checkpoints(every_steps=5),
        seed=seed,
        optimizer=keras.optimizers.Adam(1e-3),
    )
    options.update(kwargs)
    return Estimator(MLP(hidden_units=[32], dropout_rate=0.2), str(model_dir), **options)


@pytest.fixture
def input_fn(data_dir):
    return functools.partial(digits.input_fn, data_dir=data_dir)


@pytest.mark.slow
def test_ten_steps_write_checkpoints_and_events(tmp_path, input_fn):
    estimator = make_estimator(
        tmp_path, config=RunConfig(text_fn=lambda: "MLP.hidden_units = [32]\n")
    )
    metrics = estimator.train_and_evaluate(
        input_fn, {"test": input_fn}, max_steps=10, eval_every_steps=5
    )
    assert estimator.step == 10
    assert checkpoint_steps(tmp_path) == [5, 10]
    assert set(metrics) == {"test"} and set(metrics["test"]) == {"loss", "accuracy"}
    train = event_tags(os.path.join(tmp_path, "train"))
    assert {
        "loss",
        "accuracy",
        "learning_rate",
        "steps_per_sec",
        "examples_per_sec",
        "operative_config",
    } <= train
    assert [s for s, _ in scalar_series(os.path.join(tmp_path, "train"), "loss")] == [5, 10]
    eval_dir = os.path.join(tmp_path, "eval_test")
    assert [s for s, _ in scalar_series(eval_dir, "accuracy")] == [5, 10]
    assert scalar_series(eval_dir, "accuracy")[-1][1] == pytest.approx(metrics["test"]["accuracy"])
    with open(os.path.join(tmp_path, "operative_config.gin")) as f:
        assert "MLP.hidden_units" in f.read()


def test_rerun_resumes_and_does_not_retrain(tmp_path, input_fn):
    make_estimator(tmp_path).train(input_fn, max_steps=10)
    again = make_estimator(tmp_path, seed=1)  # fresh weights, restored from the checkpoint
    assert again.train(input_fn, max_steps=10) == 10
    assert checkpoint_steps(tmp_path) == [5, 10]
    assert again.train(input_fn, max_steps=15) == 15
    assert checkpoint_steps(tmp_path) == [5, 10, 15]


@pytest.mark.slow
def test_resume_continues_from_the_exact_batch(tmp_path, input_fn):
    """10 + 10 steps across two Estimators equal 20 uninterrupted steps, bit for bit."""
    straight = make_estimator(tmp_path / "straight")
    straight.train(input_fn, max_steps=20)
    first = make_estimator(tmp_path / "split")
    first.train(input_fn, max_steps=10)
    second = make_estimator(tmp_path / "split", seed=7)  # other init and RNG: all restored
    second.train(input_fn, max_steps=20)
    for a, b in zip(
        straight.model_fn.trainable_variables, second.model_fn.trainable_variables, strict=True
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.slow
def test_prefetching_to_the_device_resumes_from_the_exact_batch(tmp_path, input_fn):
    """Reading a batch ahead still reads exactly a block's batches: 10 + 10 steps with
    prefetching equal 20 steps with it and 20 steps without, bit for bit."""
    plain = make_estimator(tmp_path / "plain")
    plain.train(input_fn, max_steps=20)
    make_estimator(tmp_path / "split", devices=Devices(prefetch=True)).train(input_fn, max_steps=10)
    second = make_estimator(tmp_path / "split", seed=7, devices=Devices(prefetch=True))
    second.train(input_fn, max_steps=20)
    for a, b in zip(
        plain.model_fn.trainable_variables, second.model_fn.trainable_variables, strict=True
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_evaluate_covers_the_whole_eval_set(tmp_path, input_fn):
    estimator = make_estimator(tmp_path)
    estimator.train(input_fn, max_steps=20)
    metrics = estimator.evaluate(input_fn, name="test")  # 360 examples in batches of 100
    assert (
        estimator.model.steps.eval.metrics.count.numpy() == digits.NUM_EXAMPLES - digits.NUM_TRAIN
    )
    predictions = list(estimator.predict(input_fn))
    labels = np.concatenate([y["label"].numpy() for _, y in input_fn(Mode.EVAL, _params(100))])
    accuracy = np.mean([p["classes"] for p in predictions] == labels)
    assert metrics["accuracy"] == pytest.approx(accuracy, abs=1e-9)
    one_batch = estimator.evaluate(input_fn, steps=1, name="test")
    assert estimator.model.steps.eval.metrics.count.numpy() == 100
    assert one_batch.keys() == metrics.keys()


def test_log_steps_fall_where_asked_across_loop_blocks(tmp_path, input_fn):
    """train's epochs are its log periods: a callback's on_epoch_end sees each log step."""
    calls = []
    estimator = make_estimator(
        tmp_path, steps_per_loop=7, log_every_steps=5, checkpoints=Checkpoints(every_steps=6)
    )
    at_logs = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: calls.append((estimator.step, logs))
    )
    estimator.train(input_fn, max_steps=17, callbacks=[at_logs])
    assert [s for s, _ in calls] == [5, 10, 15, 17]
    assert checkpoint_steps(tmp_path) == [6, 12, 17]
    assert all(set(logs) == {"loss", "accuracy"} for _, logs in calls)  # fit's: no rate


def test_learning_rate_schedule_is_logged_as_applied(tmp_path, input_fn):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=5, decay_rate=0.5)
    estimator = make_estimator(tmp_path, optimizer=keras.optimizers.SGD(schedule))
    estimator.train(input_fn, max_steps=10)
    logged = dict(scalar_series(os.path.join(tmp_path, "train"), "learning_rate"))
    assert logged[5] == pytest.approx(0.05) and logged[10] == pytest.approx(0.025)


def test_evaluate_without_checkpoint_is_a_user_error(tmp_path, input_fn):
    with pytest.raises(UserError, match="no checkpoint in"):
        make_estimator(tmp_path).evaluate(input_fn)


def test_input_fn_must_return_a_dataset_of_pairs(tmp_path):
    estimator = make_estimator(tmp_path)
    with pytest.raises(UserError, match="must return a tf.data.Dataset"):
        estimator.train(lambda mode, params: [1, 2, 3], max_steps=1)
    features_only = tf.data.Dataset.from_tensors({"image": tf.zeros([2, 8, 8, 1])})
    with pytest.raises(UserError, match=r"need \(features, labels\)"):
        estimator.train(lambda mode, params: features_only, max_steps=1)


def test_an_iterator_through_a_stateful_op_is_named_when_its_checkpoint_fails(tmp_path):
    """tf.data will not save an iterator through a py_function: the line says what to do,
    and no half-written checkpoint is left."""
    images, labels = np.zeros([64, 8, 8, 1], "float32"), np.zeros([64], "int64")

    def input_fn(mode, params):
        dataset = tf.data.Dataset.from_tensor_slices(({"image": images}, labels)).repeat()
        through_python = lambda f, y: (  # noqa: E731
            f,
            {"label": tf.reshape(tf.py_function(lambda v: v, [y], tf.int64), [])},
        )
        return dataset.map(through_python).batch(params.batch_size)

    with pytest.raises(UserError, match="runs a stateful op .*trainer.positioned") as caught:
        make_estimator(tmp_path).train(input_fn, max_steps=5)
    assert "\n" not in str(caught.value) and "free space" not in str(caught.value)
    assert checkpoint_steps(tmp_path) == []


def _params(batch_size):
    from trainer import InputParams

    return InputParams(batch_size=batch_size, global_batch_size=batch_size, seed=0)


@pytest.mark.slow
def test_xla_compiled_step_trains_to_the_same_place(tmp_path, input_fn):
    """Without dropout (whose random draws differ under XLA) the arithmetic agrees."""

    def run(name, jit):
        keras.utils.set_random_seed(0)
        estimator = Estimator(
            MLP(hidden_units=[32]),
            str(tmp_path / name),
            seed=0,
            optimizer=keras.optimizers.SGD(0.1),
            global_batch_size=32,
            steps_per_loop=5,
            devices=Devices(jit_compile=jit),
        )
        estimator.train(input_fn, max_steps=10)
        return estimator

    plain, xla = run("plain", False), run("xla", True)
    assert xla.step == 10
    for a, b in zip(
        plain.model_fn.trainable_variables, xla.model_fn.trainable_variables, strict=True
    ):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
