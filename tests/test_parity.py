"""The same numbers as Keras: the parity matrix of tests/support/parity.py, cell by cell.

Every row (a model feature) under every column (how the framework trains it) ends
within the column's tolerance of Keras's own step on the same weights and batches,
or is refused in one line; a cell still known to differ is listed in ``DIFFER`` with
why, and fails the day it starts to agree (strict xfail), so that the list stays true.
"""

import logging
import os
import tempfile

import pytest

from tests.support import chats, parity
from tests.support.helpers import on_two_cpus, on_workers
from tests.support.parity import check

IN_PROCESS = [name for name, column in parity.COLUMNS.items() if column.devices == 1]
TWO_DEVICES = [
    name for name, column in parity.COLUMNS.items() if column.devices == 2 and not column.workers
]

# Cells that still compute something else than one device; see the matrix in docs/guide/keras.md.
PART_MEANS = "the negative control: each part's token mean, averaged as if parts held alike"
DIFFER: dict[tuple[str, str], str] = {
    **{("part_token_means", c): PART_MEANS for c in ("microbatches_2", "microbatches_4")},
    **{("part_token_means", c): PART_MEANS for c in ("towers", "mirrored")},
    ("add_loss_sum", "microbatches_2"): "add_loss values are taken as means: said in the log",
    ("add_loss_sum", "microbatches_4"): "add_loss values are taken as means: said in the log",
    ("add_loss_sum", "towers"): "add_loss values are taken as means: said in the log",
    ("add_loss_sum", "mirrored"): "add_loss values are taken as means: said in the log",
}


def cells(columns):
    """The cells of ``columns``, row by row: a row's Keras reference is computed once a
    process (``keras_run`` keeps it), and pytest-xdist hands each worker a run of
    consecutive cells, so that the two workers seldom both compute one."""
    return [
        pytest.param(
            row,
            column,
            marks=pytest.mark.xfail(strict=True, reason=DIFFER[row, column])
            if (row, column) in DIFFER
            else (),
        )
        for row in parity.ROWS
        for column in columns
        if row in (parity.COLUMNS[column].rows or parity.ROWS)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("row, column", cells(IN_PROCESS))
def test_cell(row, column, tmp_path):
    check(f"{row} {column}", parity.cell(row, column, str(tmp_path / "model")))


def compared(name: str, result: dict) -> dict:
    """A cell's result as ``check`` takes it: a recipe's weights compared here with
    the recipe trained on one device (in this process)."""
    row = name.split()[0]
    return parity.recipe_result(row, result) if row in parity.RECIPES else result


@pytest.mark.slow
def test_two_device_cells():
    """Every row and the recipe row under towers and mirrored, in one process that split
    its CPU in two (one test, so that the suite's two workers do not both start it)."""
    rows = [*parity.ROWS, *parity.RECIPES]
    found = on_two_cpus("tests.support.parity", "cells", ",".join(rows), ",".join(TWO_DEVICES))
    assert len(found) == len(rows) * len(TWO_DEVICES)
    failures, differing = [], set()
    for name, result in found.items():
        try:
            check(name, compared(name, result))
        except AssertionError as error:
            failures.append(str(error).splitlines()[0])
            differing.add(tuple(name.split()))
    known = {cell for cell in DIFFER if cell[1] in TWO_DEVICES}
    assert differing == known, "\n".join(failures)


@pytest.mark.slow
def test_multi_worker_cells(tmp_path):
    """The multi_worker column's rows, on two worker processes on 127.0.0.1 (one
    cluster for every cell: a process joins one); each worker finds them equal."""
    # DPO's reference pass, once, before the cluster starts (the workers read its scores)
    scored = os.path.dirname(chats.scored_pairs()["reference"])
    found = on_workers(2, "tests.support.parity", "worker_cells", str(tmp_path), scored)
    failures = []
    for worker, cells_found in enumerate(found):
        assert len(cells_found) == len(parity.MULTI_WORKER) + len(parity.SEVERAL_MACHINES)
        for name, result in cells_found.items():
            try:
                check(name, compared(name, result))
            except AssertionError as error:
                failures.append(f"worker {worker}: {str(error).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def test_a_batch_cut_in_parts_says_how_it_takes_a_layers_own_add_loss(tmp_path, caplog):
    """The cells above that differ are not silent: the log names the layer."""
    caplog.set_level(logging.INFO)
    parity.framework_run(parity.ROWS["add_loss_sum"], str(tmp_path), 1, microbatches=2)
    said = [r.getMessage() for r in caplog.records if "add losses of their own" in r.getMessage()]
    assert len(said) == 1 and "'added_loss'" in said[0] and "ops.mean" in said[0], said


@pytest.mark.slow
def test_keras_applications_mobilenet_fed_x_y_as_keras_users_feed_it():
    """keras.applications' MobileNetV2 (batch norm throughout), fed ``(x, y)`` tensors:
    each of three steps here and by Keras, from the same weights on the same batch, leaves
    every weight and moving statistic within 1e-5 of the other's.

    Each step starts from the framework's weights (Keras's model takes them before its
    step), since such a net is chaotic: on these batches Keras against itself, its
    weights scaled by 1 + 1e-7, is 8e-5 apart after one step and 0.29 after three (AMD
    EPYC; other CPUs round otherwise). The framework's step is within 6e-8 of Keras's
    (the last bit of some gradients differs), which three free steps would grow to 0.28,
    as Keras's own would. Training resumes between the steps: each takes the next batch.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import trainer

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, size=(24, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=24)

    def make():
        keras.utils.set_random_seed(0)
        model = keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10
        )
        model.compile(keras.optimizers.SGD(0.005), "sparse_categorical_crossentropy")
        return model

    def input_fn(mode, params):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(params.batch_size)

    ours, theirs = make(), make()
    assert len(ours.weights) == len(theirs.weights) > 200
    with tempfile.TemporaryDirectory() as model_dir:
        estimator = trainer.Estimator(
            ours,
            model_dir,
            global_batch_size=8,
            checkpoints=trainer.Checkpoints(every_steps=None),
            progress=False,
        )
        for step in range(1, 4):
            theirs.set_weights(ours.get_weights())
            theirs.train_on_batch(x[(step - 1) * 8 : step * 8], y[(step - 1) * 8 : step * 8])
            assert estimator.train(input_fn, max_steps=step) == step
            for mine, keras_weight in zip(ours.weights, theirs.weights, strict=True):
                np.testing.assert_allclose(
                    mine, keras_weight, atol=1e-5, rtol=0, err_msg=f"step {step}: {mine.path}"
                )


@pytest.mark.slow
def test_a_summed_loss_of_a_models_own_step_is_reported_as_the_whole_batchs_sum():
    """Under a strategy it was the mean of the replicas' sums: half, on two."""
    found = on_two_cpus("tests.support.parity", "reported_summed_losses", "towers:1,mirrored:2")
    assert found["mirrored:2"] == pytest.approx(found["towers:1"], rel=1e-5)
    assert found["towers:1"] > 10  # a sum over 16 examples, not their mean
