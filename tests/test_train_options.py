"""Early stopping, warm start, timestamped run directories and eager debugging."""

import functools
import os
import re

import keras
import numpy as np
import pytest

from datasets import digits
from models.mlp import MLP
from tests.support.commands import run_cli
from tests.support.helpers import checkpoint_steps
from trainer import Estimator
from trainer.settings import EarlyStop, WarmStart


def estimator(model_dir, **kwargs):
    keras.utils.set_random_seed(kwargs.pop("seed", 0))
    options = dict(global_batch_size=32, steps_per_loop=10, log_every_steps=10)
    options.update(kwargs)
    return Estimator(MLP(hidden_units=[16]), str(model_dir), **options)


@pytest.mark.slow
def test_early_stopping_after_patience_evaluations_without_improvement_resumed_too(
    tmp_path, data_dir
):
    input_fn = functools.partial(digits.input_fn, data_dir=data_dir)
    frozen = estimator(
        tmp_path,
        optimizer=keras.optimizers.SGD(0.0),  # nothing improves
        early_stop=EarlyStop(metric="accuracy", patience=2),
    )
    frozen.train_and_evaluate(input_fn, input_fn, max_steps=1000, eval_every_steps=10)
    assert frozen.step == 30  # best at 10, no better at 20 and 30
    assert checkpoint_steps(tmp_path)[-1] == 30
    for max_steps in (20, 1000):  # stopped at 20 and rerun: it stops where the first did
        resumed = estimator(
            tmp_path / "resumed",
            optimizer=keras.optimizers.SGD(0.0),
            early_stop=EarlyStop(metric="accuracy", patience=2),
        )
        resumed.train_and_evaluate(input_fn, input_fn, max_steps, eval_every_steps=10)
    assert resumed.step == 30


def test_warm_start_takes_the_matching_weights_only(tmp_path, data_dir):
    input_fn = functools.partial(digits.input_fn, data_dir=data_dir)
    source = estimator(tmp_path / "source")
    source.train(input_fn, 20)
    warm = estimator(
        tmp_path / "warm",
        seed=5,
        warm_start=WarmStart(source=str(tmp_path / "source"), pattern="^dense/"),
    )
    warm.train(input_fn, 1)
    fresh = estimator(tmp_path / "fresh", seed=5)
    fresh.train(input_fn, 1)
    by_path = {v.path: v.numpy() for v in warm.model_fn.trainable_variables}
    source_weights = {v.path: v.numpy() for v in source.model_fn.trainable_variables}
    fresh_weights = {v.path: v.numpy() for v in fresh.model_fn.trainable_variables}
    # One step of training moves the warm-started weights a little from the source's.
    assert (
        np.abs(by_path["dense/dense_0/kernel"] - source_weights["dense/dense_0/kernel"]).max()
        < 0.01
    )
    assert np.allclose(by_path["logits/kernel"], fresh_weights["logits/kernel"], atol=0.01)
    assert not np.allclose(by_path["logits/kernel"], source_weights["logits/kernel"], atol=0.01)


@pytest.mark.slow
def test_timestamped_model_dir_and_run_eagerly(tmp_path, data_dir):
    proc = run_cli(
        "--gin_file",
        "experiments/digits_mlp.gin",
        "--gin_file",
        "experiments/smoke.gin",
        "--run_eagerly",
        "--model_dir",
        str(tmp_path / "run-{timestamp}"),
        "--gin_param",
        f"digits.input_fn.data_dir = '{data_dir}'",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = os.listdir(tmp_path)
    assert re.fullmatch(r"run-\d{8}-\d{6}", run)
    assert checkpoint_steps(tmp_path / run) == [10]
