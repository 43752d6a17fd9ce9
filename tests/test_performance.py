"""Speed features that change what a run does: the input-bound report, mixed precision.

Speed itself is measured in benchmarks/, never asserted here.
"""

import functools
import logging
import os
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets import digits
from models.mlp import MLP
from tests.support.helpers import scalar_series
from trainer import Estimator, Mode, UserError, set_precision
from trainer.settings import Checkpoints, Devices, Summaries


def estimator(model_dir, **kwargs):
    keras.utils.set_random_seed(0)
    options = dict(
        global_batch_size=64,
        steps_per_loop=10,
        log_every_steps=10,
        checkpoints=Checkpoints(every_steps=None),
        seed=0,
        summaries=Summaries(write_graph=False),
    )
    options.update(kwargs)
    model = options.pop("model", None) or MLP(hidden_units=[64], dropout_rate=0.0)
    return Estimator(model, str(model_dir), **options)


def in_memory(mode, params, delay=0.0):
    images = tf.random.stateless_uniform([params.batch_size, 8, 8, 1], seed=[1, 2])
    labels = tf.random.stateless_uniform([params.batch_size], [3, 4], maxval=10, dtype=tf.int64)
    dataset = tf.data.Dataset.from_tensors(({"image": images}, {"label": labels})).repeat()
    if delay:  # a pipeline that takes `delay` seconds per batch

        def slowly(features, labels):
            zero = tf.numpy_function(lambda: time.sleep(delay) or np.int64(0), [], tf.int64)
            return features, {"label": labels["label"] + tf.ensure_shape(zero, [])}

        dataset = dataset.map(slowly)
    return dataset


@pytest.mark.slow
def test_input_bound_run_is_reported_with_the_knobs_to_turn(tmp_path, caplog):
    slow = estimator(tmp_path / "slow", checkpoints=Checkpoints(input=False))
    with caplog.at_level(logging.INFO, logger="absl"):
        slow.train(functools.partial(in_memory, delay=0.02), max_steps=30)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        m.startswith("Training is input-bound") and "pipeline.cache" in m for m in warnings
    ), warnings
    shares = [v for _, v in scalar_series(str(tmp_path / "slow" / "train"), "input_wait_share")]
    assert shares and shares[-1] > 0.5  # the first block traces, and is not counted

    caplog.clear()
    # Compute a step can wait behind: with a toy model the iterator's own per-call
    # cost (tens of microseconds) is a real share of the step.
    fast = estimator(tmp_path / "fast", model=MLP(hidden_units=[1024, 1024]))
    with caplog.at_level(logging.INFO, logger="absl"):
        fast.train(in_memory, max_steps=30)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("input-bound" in m for m in messages)
    assert any(m.startswith("Input: the steps waited for data") for m in messages)
    shares = [v for _, v in scalar_series(str(tmp_path / "fast" / "train"), "input_wait_share")]
    assert shares[-1] < 0.2


def pause(seconds: float, after: tf.Tensor) -> tf.Tensor:
    """A float32 zero computed from ``after`` in ``seconds`` (sleeping). Not stateful,
    so the runtime orders it by its data alone, as it does real compute."""
    zero = tf.numpy_function(
        lambda _: time.sleep(seconds) or np.float32(0), [after], tf.float32, stateful=False
    )
    return tf.ensure_shape(zero, [])


@tf.custom_gradient
def slow_gradient(loss):
    # Paused after the loss: an upstream gradient of ones is the same at every step, and
    # a pause computed from it alone would be hoisted out of the training loop.
    return tf.identity(loss), lambda upstream: upstream + pause(0.03, loss)


class SlowMLP(MLP):
    """An MLP whose training step takes 10 ms more forward and 30 ms more backward."""

    def __init__(self):
        super().__init__(hidden_units=[16], dropout_rate=0.0)

    def __call__(self, features, labels, mode):
        spec = super().__call__(features, labels, mode)
        if mode == Mode.TRAIN:
            spec.loss = slow_gradient(spec.loss + pause(0.01, spec.loss))
        return spec


@pytest.mark.slow
def test_prefetch_to_device_reads_the_next_batch_while_the_step_runs(tmp_path):
    """A 20 ms read beside a 40 ms step (10 forward, 30 backward): waited for without
    prefetching, hidden with it but for the first batch of each block. The read stands
    for the copy to a GPU, which no tf.data buffer on the host hides; tf.data's own
    prefetch is off."""

    def unbuffered(mode, params):
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        return in_memory(mode, params, delay=0.02).with_options(options)

    def measured(prefetch: bool, attempt: int = 0):
        keras.utils.set_random_seed(0)  # the same initial weights
        model_dir = tmp_path / f"{prefetch}-{attempt}"
        run = estimator(
            model_dir,
            model=SlowMLP(),
            checkpoints=Checkpoints(input=False),
            devices=Devices(prefetch=prefetch),
        )
        assert (run.placement.prefetch_device is not None) == prefetch
        run.train(unbuffered, max_steps=30)
        series = scalar_series(str(model_dir / "train"), "input_wait_share")
        # steps 21-30 (the first block traces)
        return series[-1][1], [v.numpy() for v in run.model_fn.trainable_variables]

    shares, weights = {}, {}
    shares[False], weights[False] = measured(False)
    # The read hides behind the step on a thread of its own: with the suite's other
    # worker on both cores it may not get one in time, so it is measured up to 3 times.
    for attempt in range(3):
        shares[True], weights[True] = measured(True, attempt)
        if shares[True] < 0.15:
            break
    assert shares[False] > 0.2, shares
    assert shares[True] < 0.15, shares  # ~0.05: each block's first batch
    for a, b in zip(weights[False], weights[True], strict=True):
        np.testing.assert_array_equal(a, b)  # the same training


def test_prefetch_to_device_is_refused_where_it_does_not_apply(tmp_path):
    model = MLP(hidden_units=[8])
    with pytest.raises(UserError, match="Devices.prefetch applies to one device .*not jit_compile"):
        Estimator(
            model,
            str(tmp_path),
            devices=Devices(prefetch=True, jit_compile=True),
        )
    auto = Estimator(model, str(tmp_path)).placement.prefetch_device  # one device: on
    assert auto is not None and tf.DeviceSpec.from_string(auto).device_type == "CPU"
    compiled = Estimator(model, str(tmp_path), devices=Devices(jit_compile=True))
    assert compiled.placement.prefetch_device is None  # jit_compile reads a block's batches first


@pytest.fixture
def policy():
    """Mixed-precision tests set Keras's global policy; put float32 back after each."""
    yield set_precision
    set_precision(None)


@pytest.mark.slow
def test_bfloat16_trains_digits_as_well_as_float32(tmp_path, data_dir, policy):
    input_fn = functools.partial(digits.input_fn, data_dir=data_dir)
    results = {}
    for precision in [None, "mixed_bfloat16"]:
        policy(precision)
        model = MLP(hidden_units=[128], dropout_rate=0.0)
        run = estimator(
            tmp_path / str(precision), model=model, devices=Devices(mixed_precision=precision)
        )
        run.train(input_fn, max_steps=300)
        results[precision] = run.evaluate(input_fn)
        if precision:
            assert model.layers[0].compute_dtype == "bfloat16"
            assert all(v.dtype == "float32" for v in model.trainable_variables)
    assert results["mixed_bfloat16"]["accuracy"] > 0.9
    assert results["mixed_bfloat16"]["accuracy"] == pytest.approx(
        results[None]["accuracy"], abs=0.02
    )


def test_float16_wraps_the_optimizer_in_loss_scaling(tmp_path, policy):
    policy("mixed_float16")
    run = estimator(tmp_path, devices=Devices(mixed_precision="mixed_float16"))
    assert isinstance(run.optimizer, keras.optimizers.LossScaleOptimizer)
    run.train(in_memory, max_steps=20)
    assert run.step == 20
    scale = float(run.optimizer.dynamic_scale.numpy())
    assert 0 < scale <= 2.0**15
    reader = tf.train.load_checkpoint(str(tmp_path))
    assert any("dynamic_scale" in name for name in reader.get_variable_to_shape_map())


def test_precision_set_after_the_model_was_made_is_refused(tmp_path):
    model = MLP(hidden_units=[8])  # made under float32
    with pytest.raises(UserError, match=r"call trainer.set_precision\('mixed_bfloat16'\) before"):
        Estimator(model, str(tmp_path), devices=Devices(mixed_precision="mixed_bfloat16"))
    with pytest.raises(UserError, match="mixed_precision must be None, 'mixed_bfloat16' or"):
        Estimator(model, str(tmp_path), devices=Devices(mixed_precision="bf16"))
    assert not os.listdir(tmp_path)


def test_jit_compile_stacks_at_most_256_mb_of_fixed_shape_batches():
    from trainer.feeding import stackable_steps

    batch = (tf.TensorSpec([128, 28, 28, 1], tf.float32), tf.TensorSpec([128], tf.int64))
    assert stackable_steps(batch) == 256 * 2**20 // (128 * 784 * 4 + 128 * 8)
    assert stackable_steps(tf.TensorSpec([512, 224, 224, 3], tf.float32)) == 1
    with pytest.raises(UserError, match="fixed size.*drop_remainder=True"):
        stackable_steps(tf.TensorSpec([None, 4]))
    assert stackable_steps(tf.TensorSpec([8, None], tf.int64)) == 0  # compiled per shape
