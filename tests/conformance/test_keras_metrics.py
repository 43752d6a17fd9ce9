"""Keras 3.15's metric tests that touch sample weights, masks and ``ignore_class``, ported.

Each case's ``y_pred`` is the output of a model that passes it through (as in the loss
ports), compiled with the metric, and the Estimator's evaluation must report the
number Keras's test asserts. A test that updates a metric twice is one evaluation
over two batches, the first update's rows then the second's.

From ``metrics/accuracy_metrics_test.py`` (the weighted cases: rank 1, per position,
broadcast), ``metrics/probabilistic_metrics_test.py`` (``ignore_class``, weighted),
``metrics/regression_metrics_test.py`` (MSE weighted) and
``trainers/compile_utils_test.py`` (``CompileMetrics``: plain and weighted metrics of one
output, a list and a dict). The compiled loss, which these tests do not have, is a zero.
"""

import keras
import numpy as np
import pytest

from tests.support.pass_through import evaluated, evaluated_outputs

pytestmark = pytest.mark.slow  # each runs an evaluation


def no_loss(y_true, y_pred):
    return keras.ops.zeros_like(y_pred)


metrics = keras.metrics
ACC_TRUE, ACC_PRED = [[1], [2], [3], [4]], [[0], [2], [3], [4]]
BIN_TRUE, BIN_PRED = [[1], [1], [0], [0]], [[0.98], [1], [0], [0.6]]
CAT_TRUE = [[0, 0, 1], [0, 1, 0]]
CAT_PRED = [[0.1, 0.1, 0.8], [0.05, 0, 0.95]]
SCCE_TRUE = [0, 1, 2]
SCCE_PRED = [[0.8, 0.1, 0.1], [0.05, 0.95, 0], [0.1, 0.8, 0.1]]

CASES = {  # Keras's test: (metric, y_true, y_pred, sample_weight, what Keras asserts)
    "Accuracy.test_unweighted": (metrics.Accuracy(), ACC_TRUE, ACC_PRED, None, 0.75),
    "Accuracy.test_weighted": (metrics.Accuracy(), ACC_TRUE, ACC_PRED, [1, 1, 0, 0], 0.5),
    "Accuracy.test_weighted_rank_1": (
        metrics.Accuracy(), [1, 2, 3, 4], [0, 2, 3, 4], [1, 1, 0, 0], 0.5,
    ),
    "Accuracy.test_weighted_nd_weights": (
        metrics.Accuracy(), [[1, 2], [3, 4]], [[0, 2], [3, 4]], [[1, 0], [0, 1]], 0.5,
    ),
    "Accuracy.test_weighted_nd_broadcast_weights": (
        metrics.Accuracy(), [[1, 2], [3, 4]], [[0, 2], [3, 4]], [[1, 0], [1, 0]], 0.5,
    ),
    "BinaryAccuracy.test_unweighted": (metrics.BinaryAccuracy(), BIN_TRUE, BIN_PRED, None, 0.75),
    "BinaryAccuracy.test_weighted": (
        metrics.BinaryAccuracy(), BIN_TRUE, BIN_PRED, [1, 0, 0, 1], 0.5,
    ),
    "BinaryAccuracy.test_weighted_rank_1": (
        metrics.BinaryAccuracy(), [1, 1, 0, 0], [0.98, 1, 0, 0.6], [1, 0, 0, 1], 0.5,
    ),
    "BinaryAccuracy.test_weighted_nd_weights": (
        metrics.BinaryAccuracy(), [[1, 1], [0, 0]], [[0.98, 1], [0, 0.6]], [[1, 0], [0, 1]], 0.5,
    ),
    "BinaryAccuracy.test_weighted_nd_broadcast_weights": (
        metrics.BinaryAccuracy(), [[1, 1], [0, 0]], [[0.98, 1], [0, 0.6]], [[1, 0], [1, 0]], 1.0,
    ),
    "CategoricalAccuracy.test_weighted": (
        metrics.CategoricalAccuracy(), CAT_TRUE, CAT_PRED, [0.7, 0.3], 0.7,
    ),
    "SparseCategoricalAccuracy.test_weighted": (
        metrics.SparseCategoricalAccuracy(), [[2], [1]], CAT_PRED, [0.7, 0.3], 0.7,
    ),
    "SparseCategoricalCrossentropy.test_ignore_class": (
        metrics.SparseCategoricalCrossentropy(ignore_class=0), SCCE_TRUE, SCCE_PRED, None,
        0.78462,
    ),
    "SparseCategoricalCrossentropy.test_ignore_class_weighted": (
        metrics.SparseCategoricalCrossentropy(ignore_class=0), SCCE_TRUE, SCCE_PRED,
        [0.5, 1.5, 2.0], 1.33774646,
    ),
    "MeanSquaredError.test_weighted": (
        metrics.MeanSquaredError(),
        [[0, 1, 0, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]],
        [[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0], [1, 1, 1, 1, 1]],
        [1.0, 1.5, 2.0, 2.5], 0.54285,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_keras_metric_case_evaluates_to_what_keras_asserts(case, tmp_path):
    metric, y_true, y_pred, sample_weight, expected = CASES[case]
    compiled = {"loss": no_loss, "weighted_metrics": [metric]}
    logs = evaluated(compiled, y_true, y_pred, sample_weight, model_dir=tmp_path)
    assert logs[metric.name] == pytest.approx(expected, abs=1e-3)


def test_a_metric_skips_the_positions_masked_on_its_output(tmp_path):
    """MeanMetricWrapper reads the mask set on ``y_pred`` (``reduction_metrics.py``)."""
    compiled = {"loss": no_loss, "weighted_metrics": [metrics.MeanAbsoluteError()]}
    y_true = np.reshape([1.0, 0.0, 1.0, 0.0], (1, 4, 1))
    y_pred = np.reshape([0.1, 0.2, 0.3, 0.4], (1, 4, 1))  # a sequence of 4 values, 1 masked
    mask = [[True, False, True, True]]
    logs = evaluated(compiled, y_true, y_pred, mask=mask, model_dir=tmp_path)
    assert logs["mean_absolute_error"] == pytest.approx((0.9 + 0.7 + 0.4) / 3, abs=1e-6)


A_TRUE = [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]
A_PRED_1 = [[0.4, 0.1], [0.2, 0.6], [0.6, 0.1]]
A_PRED_2 = [[0.3, 0.2], [0.1, 0.4], [0.2, 0.3]]
COMPILE_WEIGHTS = [1, 0.0, 1]


def test_compile_metrics_single_output_case(tmp_path):
    """``CompileMetrics.test_single_output_case``: two updates of plain and weighted MSE."""
    compiled = {
        "loss": no_loss,
        "metrics": [metrics.MeanSquaredError()],
        "weighted_metrics": [metrics.MeanSquaredError()],
    }
    logs = evaluated(
        compiled, A_TRUE * 2, A_PRED_1 + A_PRED_2, COMPILE_WEIGHTS * 2, model_dir=tmp_path, batch=3
    )
    assert logs["mean_squared_error"] == pytest.approx(0.055833336, abs=1e-6)
    assert logs["weighted_mean_squared_error"] == pytest.approx(0.0725, abs=1e-6)


def test_compile_metrics_dict_output_case(tmp_path):
    """``CompileMetrics.test_dict_output_case``: each output's metrics named by its name."""

    def both():  # each output's own metric objects
        return [metrics.MeanSquaredError(), metrics.MeanSquaredError(name="mse")]

    outputs = ("output_1", "output_2")
    compiled = {
        "loss": no_loss,
        "metrics": {name: both() for name in outputs},
        "weighted_metrics": {name: both() for name in outputs},
    }
    y_true = {
        "output_1": A_TRUE * 2,
        "output_2": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]] * 2,
    }
    y_pred = {
        "output_1": A_PRED_1 + A_PRED_2,
        "output_2": [[0.4, 0.1, 0.3], [0.2, 0.6, 0.4], [0.6, 0.1, 0.8]]
        + [[0.3, 0.2, 0.1], [0.5, 0.4, 0.6], [0.1, 0.8, 0.7]],
    }
    logs = evaluated_outputs(
        compiled, y_true, y_pred, COMPILE_WEIGHTS * 2, model_dir=tmp_path, batch=3
    )
    expected = {
        "output_1_mean_squared_error": 0.055833336,
        "output_2_mean_squared_error": 0.066666667,
        "output_1_mse": 0.055833336,
        "output_2_mse": 0.066666667,
        "output_1_weighted_mean_squared_error": 0.0725,
        "output_2_weighted_mean_squared_error": 0.090833336,
        "output_1_weighted_mse": 0.0725,
        "output_2_weighted_mse": 0.090833336,
    }
    assert {name: logs[name] for name in expected} == pytest.approx(expected, abs=1e-6)
