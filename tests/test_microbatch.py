"""``Optimization.microbatches``: a step's batch in slices trains as the whole batch does."""

import functools
import os

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

from datasets import digits
from models.gan import WGANGP
from models.mlp import MLP
from tests.support import packed
from tests.support.commands import digits_args, run_cli
from tests.support.helpers import scalar_series
from trainer import Estimator, InputParams, Mode, UserError
from trainer.gradients import global_norm
from trainer.settings import Devices, Optimization

SWEEP = ["--sweep", "Optimization.microbatches = [1, 4]"]
BINDINGS = (
    "MLP.dropout_rate = 0.0",  # dropout's random draws would differ by slice
    "MLP.hidden_units = [64, 64]",
    "experiment.max_steps = 30",
    "experiment.eval_every_steps = None",
    "Checkpoints.every_steps = 30",
    "Estimator.log_every_steps = 10",
    "Estimator.steps_per_loop = 10",
)


def saved(model_dir) -> dict:
    """The weights and optimizer state of ``model_dir``'s newest checkpoint."""
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(model_dir)))
    keys = reader.get_variable_to_shape_map()
    return {k: reader.get_tensor(k) for k in keys if k.startswith(("model/", "optimizer/"))}


@pytest.mark.slow
@pytest.mark.parametrize("devices", [[], ["--num_devices", "2"]], ids=["one_device", "towers"])
def test_four_microbatches_train_as_the_whole_batch(tmp_path, data_dir, devices):
    """Through the CLI, one sweep of microbatches 1 and 4: the same losses, weights and
    Adam state within 1e-5 after 30 steps, each step one update of the whole batch."""
    args = digits_args(data_dir, tmp_path, *SWEEP, *devices)
    for binding in BINDINGS:
        args += ["--gin_param", binding]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole, sliced = tmp_path / "microbatches=1", tmp_path / "microbatches=4"
    expected, actual = saved(whole), saved(sliced)
    assert expected.keys() == actual.keys()
    assert int(actual["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == 30
    for key, value in expected.items():
        np.testing.assert_allclose(actual[key], value, rtol=1e-5, atol=1e-5, err_msg=key)
    losses = [scalar_series(os.path.join(d, "train"), "loss") for d in (whole, sliced)]
    assert [s for s, _ in losses[1]] == [10, 20, 30]
    np.testing.assert_allclose([v for _, v in losses[1]], [v for _, v in losses[0]], rtol=1e-5)


@pytest.fixture(scope="module")
def uneven_runs(tmp_path_factory, data_dir):
    """Six steps of 30 examples, taken whole, in 4 uneven slices (7, 8, 7, 8), one example
    at a time (40 slices asked), and under XLA in 3 slices of 10 or whole."""
    input_fn = functools.partial(digits.input_fn, data_dir=data_dir)
    weights = {}
    for name, options in {
        "whole": {},
        "4": dict(optimization=Optimization(microbatches=4)),
        "40": dict(optimization=Optimization(microbatches=40)),
        "xla": dict(devices=Devices(jit_compile=True)),
        "xla 3": dict(devices=Devices(jit_compile=True), optimization=Optimization(microbatches=3)),
    }.items():
        keras.utils.set_random_seed(0)
        estimator = Estimator(
            MLP(hidden_units=[32], dropout_rate=0.0),
            str(tmp_path_factory.mktemp("uneven")),
            optimizer=keras.optimizers.SGD(0.1),
            global_batch_size=30,
            steps_per_loop=3,
            seed=0,
            progress=False,
            **options,
        )
        estimator.train(input_fn, max_steps=6)
        weights[name] = [v.numpy() for v in estimator.model_fn.trainable_variables]
    return weights


@pytest.mark.slow
@pytest.mark.parametrize("run,reference", [("4", "whole"), ("40", "whole"), ("xla 3", "xla")])
def test_uneven_and_single_example_slices_train_as_the_whole_batch(uneven_runs, run, reference):
    for actual, expected in zip(uneven_runs[run], uneven_runs[reference], strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_what_micro_batches_cannot_do_is_refused_in_one_line(tmp_path):
    accumulating = keras.optimizers.Adam(gradient_accumulation_steps=4)
    with pytest.raises(UserError, match=r"^the optimizer has gradient_accumulation_steps=4, "):
        Estimator(MLP(), str(tmp_path), optimizer=accumulating)
    compiled = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    compiled.compile(keras.optimizers.SGD(gradient_accumulation_steps=2), loss="mse")
    with pytest.raises(UserError, match=r"set Optimization\.microbatches = 2 \(one step stays"):
        Estimator(compiled, str(tmp_path))
    with pytest.raises(UserError, match=r"^Optimization\.microbatches must be a whole number >= 1"):
        Estimator(MLP(), str(tmp_path), optimization=Optimization(microbatches=0))
    with pytest.raises(UserError, match=r"\.train_step computes its own gradients of the whole"):
        Estimator(WGANGP(), str(tmp_path), optimization=Optimization(microbatches=2))
    with pytest.raises(UserError, match=r"Optimization\.microbatch_tokens would slice: unset it"):
        Estimator(WGANGP(), str(tmp_path), optimization=Optimization(microbatch_tokens=512))
    with pytest.raises(UserError, match=r"^Optimization\.microbatch_tokens must be a whole numb"):
        Optimization(microbatch_tokens=0)
    with pytest.raises(UserError, match=r"^Optimization\.microbatches and Optimization\.microb"):
        Optimization(microbatches=2, microbatch_tokens=512)
    assert os.listdir(tmp_path) == []


def test_a_sparse_gradients_norm_is_the_norm_of_its_dense_sum():
    """An id looked up twice is one row of the dense gradient (clipping, gradient_norm)."""
    rows = tf.constant([[3.0], [4.0], [1.0]])
    twice = tf.IndexedSlices(rows, tf.constant([0, 0, 2]), tf.constant([5, 1]))
    dense = tf.convert_to_tensor(twice)
    assert float(global_norm([twice, None])) == pytest.approx(float(tf.norm(dense)))
    assert float(global_norm([twice])) == pytest.approx(np.sqrt(7.0**2 + 1.0**2))


class SlicesCounted(packed.TokensOf):
    """The per-token model, counting the training slices it is run on."""

    def __init__(self, model):
        super().__init__(model)
        self.slices = tf.Variable(0, trainable=False, name="slices")

    def __call__(self, features, labels, mode):
        if mode == Mode.TRAIN:
            self.slices.assign_add(1)
        return super().__call__(features, labels, mode)


@pytest.mark.slow
def test_a_token_budget_slices_long_batches_more_and_trains_as_the_whole_batch(tmp_path):
    """Batches grouped by length and padded to 8, 16 or 24: a budget of 64 positions
    takes each batch of 16 in 2, 4 or 6 slices, and 5 steps end within 1e-6 of the
    whole batches' (a token mean: the slices' tokens differ), under jit_compile too
    (slices of one shape a bucket)."""
    lengths = {"lengths.group_batches": 2, "lengths.buckets": [8, 16, 24]}
    weights, counted = {}, {}
    for budget, jit in ((None, False), (64, False), (64, True)):
        for name, value in lengths.items():
            gin.bind_parameter(name, value)
        model_fns = []

        def made(model, made=model_fns):
            made.append(SlicesCounted(model))
            return made[-1]

        groups = {
            "optimization": Optimization(microbatch_tokens=budget),
            "devices": Devices(jit_compile=jit),
        }
        weights[budget, jit] = packed.trained(
            tmp_path / f"tokens={budget},{jit}", 5, False, model_fn=made, groups=groups
        )
        counted[budget, jit] = int(model_fns[0].slices.numpy())
    for run in ((64, False), (64, True)):
        for whole, sliced in zip(weights[None, False], weights[run], strict=True):
            np.testing.assert_allclose(sliced, whole, atol=1e-6)
    for name, value in lengths.items():
        gin.bind_parameter(name, value)
    params = InputParams(packed.GLOBAL, packed.GLOBAL, seed=0)
    batches = [f for f, _ in packed.input_fn()(Mode.TRAIN, params).take(5).as_numpy_iterator()]
    widths = [b["tokens"].shape[1] for b in batches]
    assert len(set(widths)) > 1  # batches of several lengths
    slices = sum(w * packed.GLOBAL // 64 for w in widths)
    assert counted[64, False] - counted[None, False] == slices - 5
    assert counted[64, True] - counted[None, False] == slices - 5
