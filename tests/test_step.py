"""The compiled step and its loop, driven directly: counting, NaN stops, three ways to fetch."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer import Devices, Mode, ModelFn, Spec
from trainer.distributed.placement import Placement
from trainer.model_state import ModelState


class Linear(ModelFn):
    """y = w.x + b with a squared error; one per-example metric."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def __call__(self, features, labels, mode):
        y = self.dense(features["x"])[:, 0]
        if labels is None:
            return Spec({"y": y})
        error = tf.square(y - labels["y"])
        return Spec({"y": y}, loss=tf.reduce_mean(error), metrics={"squared_error": error})


def batches(count=None, nan_at=None, batch=8):
    """Batches of y = 2x + 1; batch ``nan_at`` (0-based) has NaN inputs."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * batch, 3)).astype(np.float32)
    y = (x @ np.array([2.0, -1.0, 0.5], np.float32) + 1.0).astype(np.float32)
    if nan_at is not None:
        x[nan_at * batch : (nan_at + 1) * batch] = np.nan
    dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, {"y": y})).batch(batch)
    return dataset.take(count) if count else dataset.repeat()


def compiled(**devices):
    """Fresh Linear model, SGD, and its compiled steps on one CPU (reading ahead, by default)."""
    keras.utils.set_random_seed(1)
    model = ModelState(
        Linear(),
        keras.optimizers.SGD(0.05),
        Placement(Devices("towers", 1, **devices), global_batch_size=8),
        collections.Counter(),
    )
    return model, model.build(batches().element_spec, Mode.TRAIN)


def test_a_block_runs_its_steps_and_counts_them():
    model, steps = compiled()
    iterator = iter(batches())
    steps.train_loop(iterator, tf.constant(5, tf.int64))
    assert model.step == 5
    assert steps.train_metrics.count.numpy() == 5 * 8
    first = steps.train_metrics.result()["loss"]
    steps.train_metrics.reset()
    steps.train_loop(iterator, tf.constant(50, tf.int64))
    assert model.step == 55
    assert steps.train_metrics.result()["loss"] < first / 10
    assert not steps.nonfinite.numpy() and not steps.nonfinite_weights.numpy()
    assert np.isfinite(steps.gradient_norm.numpy())  # measured at the block's last step


def test_a_nan_loss_ends_the_block_at_its_step_uncounted():
    model, steps = compiled()
    steps.train_loop(iter(batches(nan_at=2)), tf.constant(10, tf.int64))
    assert steps.nonfinite.numpy()
    assert model.step == 2  # steps 1 and 2 counted, the third (NaN) not
    assert steps.nonfinite_weights.numpy()  # its update was applied: NaN weights


@pytest.mark.parametrize("way", [{"prefetch": True}, {"jit_compile": True}])
def test_every_way_of_fetching_trains_like_reading_on_demand(way):
    plain, plain_steps = compiled(prefetch=False)
    assert plain.placement.prefetch_device is None
    plain_steps.train_loop(iter(batches()), tf.constant(6, tf.int64))
    other, other_steps = compiled(**way)
    assert other.placement.prefetch_device == (
        other.placement.devices[0] if "prefetch" in way else None
    )
    other_steps.train_loop(iter(batches()), tf.constant(6, tf.int64))
    assert other.step == plain.step == 6
    pairs = zip(plain.model_fn.trainable_variables, other.model_fn.trainable_variables, strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_evaluate_and_predict_read_the_whole_dataset():
    model, steps = compiled()
    steps.eval.metrics.reset()
    steps.eval.evaluate(batches(count=3))
    assert steps.eval.metrics.count.numpy() == 24
    assert set(steps.eval.metrics.result()) == {"loss", "squared_error"}
    x = tf.zeros([5, 3])
    assert steps.eval.predict({"x": x})["y"].shape == (5,)


class Branching(Linear):
    """Linear whose call branches and loops on tensors, as AutoGraph lets a model do;
    the framework's own code on the way is not converted (``model_fn.converted``)."""

    def __call__(self, features, labels, mode):
        x = features["x"]
        if tf.reduce_mean(x) > 100.0:  # a tf.cond: never taken on these batches
            x = -x
        for _ in tf.range(2):  # a while loop
            x = x * 1.0
        return super().__call__({"x": x}, labels, mode)


def test_a_model_that_branches_on_tensors_trains_evaluates_and_predicts_as_written():
    keras.utils.set_random_seed(1)
    plain, plain_steps = compiled()
    keras.utils.set_random_seed(1)
    model = ModelState(
        Branching(),
        keras.optimizers.SGD(0.05),
        Placement(Devices("towers", 1), global_batch_size=8),
        collections.Counter(),
    )
    steps = model.build(batches().element_spec, Mode.TRAIN)
    for each in (plain_steps, steps):
        each.train_loop(iter(batches()), tf.constant(3, tf.int64))
    pairs = zip(plain.model_fn.trainable_variables, model.model_fn.trainable_variables, strict=True)
    for theirs, mine in pairs:
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    steps.eval.metrics.reset()
    steps.eval.evaluate(batches(count=2))
    assert steps.eval.metrics.count.numpy() == 16
    assert steps.eval.predict({"x": tf.fill([2, 3], 1000.0)})["y"].shape == (2,)


class Traced(Linear):
    """Linear, keeping the project's frames between ``Estimator.train`` and its TRAIN call."""

    chain: list = []

    def __call__(self, features, labels, mode):
        if mode == Mode.TRAIN:
            import traceback

            frames = traceback.extract_stack()[:-1]
            first = max(i for i, f in enumerate(frames) if f.name == "train")
            ours = [f for f in frames[first:] if "/trainer/" in f.filename]
            Traced.chain = [f"{f.filename.split('/trainer/')[-1]}:{f.name}" for f in ours]
        return super().__call__(features, labels, mode)


def test_estimator_train_reaches_the_model_in_eight_frames_over_four_files(tmp_path):
    """One step reads top to bottom: Estimator.train, the run's loop, the compiled loop,
    the step, its gradients and the model; TensorFlow's own frames in between not counted
    (run eagerly, so that the frames are the source's, not AutoGraph's conversions)."""
    from trainer import Estimator

    estimator = Estimator(Traced(), str(tmp_path), global_batch_size=8, progress=False)
    tf.config.run_functions_eagerly(True)
    try:
        estimator.train(lambda mode, params: batches(), max_steps=1)
    finally:
        tf.config.run_functions_eagerly(False)
    chain = Traced.chain
    assert chain[0] == "estimator.py:train" and chain[-1].startswith("step.py:"), chain
    print(" -> ".join(chain))
    assert len(chain) <= 8, chain
    assert len({link.split(":")[0] for link in chain}) <= 4, chain
