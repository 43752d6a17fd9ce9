"""Keras 3.15's loss tests that touch masks, ``ignore_class`` and sample weights, ported:
each case's ``y_pred`` is the output of a model that passes it through, and the
Estimator's evaluation of one batch must give the number Keras's test asserts.

From ``losses/loss_test.py`` (``ExampleLoss``, a mask set on ``y_pred``) and
``losses/losses_test.py`` (``MeanSquaredErrorTest``, ``SparseCategoricalCrossentropyTest``).
Changed on purpose: ``reduction=None`` is refused (it leaves Keras to add the values up
unsaid), so ``test_ignore_class``'s per-position values are asserted as their mean
over the positions kept, which is what ``'sum_over_batch_size'`` gives.
"""

import keras
import numpy as np
import pytest

from tests.support.pass_through import evaluated, evaluated_outputs

pytestmark = pytest.mark.slow  # each trains, or runs Keras beside the Estimator


class ExampleLoss(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return (y_true - y_pred) ** 2


Y_TRUE = [1.0, 0.0, 1.0, 0.0]
Y_PRED = [0.1, 0.2, 0.3, 0.4]
MASK = [True, False, True, True]
WEIGHTS = [0.4, 0.3, 0.2, 0.1]
MSE_TRUE = [[1, 9, 2], [-5, -2, 6]]
MSE_PRED = [[4, 8, 12], [8, 1, 3]]
SCCE_PRED = [[0.9, 0.05, 0.05], [0.5, 0.89, 0.6], [0.05, 0.01, 0.94]]
SCCE_LOGITS = [[8.0, 1.0, 1.0], [0.0, 9.0, 1.0], [2.0, 3.0, 5.0]]
TIMESTEP_TRUE = np.asarray([1, 9, 2, -5, -2, 6], "float32").reshape(2, 3, 1)
TIMESTEP_PRED = np.asarray([4, 8, 12, 8, 1, 3], "float32").reshape(2, 3, 1)
TIMESTEP_WEIGHTS = np.array([3, 6, 5, 0, 4, 2], "float32").reshape((2, 3))
masked = np.array(MASK)
MASKED_EXPECTED = np.sum((np.array(Y_TRUE)[masked] - np.array(Y_PRED)[masked]) ** 2) / 3
MASKED_WEIGHTED = (
    np.sum(np.array(WEIGHTS)[masked] * (np.array(Y_TRUE)[masked] - np.array(Y_PRED)[masked]) ** 2)
    / 3
)

CASES = {  # Keras's test: (loss, y_true, y_pred, sample_weight, mask, what Keras asserts)
    "loss_test.test_mask": (ExampleLoss(), Y_TRUE, Y_PRED, None, MASK, MASKED_EXPECTED),
    "loss_test.test_mask everything masked": (
        ExampleLoss(), Y_TRUE, Y_PRED, None, [False] * 4, 0.0,
    ),
    "loss_test.test_sample_weight": (
        ExampleLoss(), Y_TRUE, Y_PRED, WEIGHTS, None,
        np.sum(np.array(WEIGHTS) * (np.array(Y_TRUE) - np.array(Y_PRED)) ** 2) / 4,
    ),
    "loss_test.test_sample_weight every weight 0": (
        ExampleLoss(), Y_TRUE, Y_PRED, [0.0] * 4, None, 0.0,
    ),
    "loss_test.test_mask_and_sample_weight": (
        ExampleLoss(), Y_TRUE, Y_PRED, WEIGHTS, MASK, MASKED_WEIGHTED,
    ),
    "mse.test_unweighted": (keras.losses.MeanSquaredError(), MSE_TRUE, MSE_PRED, None, None, 49.5),
    "mse.test_scalar_weighted": (
        keras.losses.MeanSquaredError(), MSE_TRUE, MSE_PRED, 2.3, None, 113.85,
    ),
    "mse.test_sample_weighted": (
        keras.losses.MeanSquaredError(), MSE_TRUE, MSE_PRED, [1.2, 3.4], None, 767.8 / 6,
    ),
    "mse.test_timestep_weighted": (
        keras.losses.MeanSquaredError(),
        TIMESTEP_TRUE, TIMESTEP_PRED, TIMESTEP_WEIGHTS, None, 97.833336,
    ),
    "mse.test_zero_weighted": (keras.losses.MeanSquaredError(), MSE_TRUE, MSE_PRED, 0.0, None, 0.0),
    "mse.test_sum_reduction": (
        keras.losses.MeanSquaredError(reduction="sum"), MSE_TRUE, MSE_PRED, 2.3, None, 227.69998,
    ),
    "mse.test_mean_with_sample_weight_reduction": (
        keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
        MSE_TRUE, MSE_PRED, [1.2, 3.4], None,
        (110 / 3 * 1.2 + 187 / 3 * 3.4) / (1.2 + 3.4),
    ),
    "scce.test_unweighted": (
        keras.losses.SparseCategoricalCrossentropy(), [0, 1, 2], SCCE_PRED, None, None, 0.3239,
    ),
    "scce.test_unweighted logits": (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        [0, 1, 2], SCCE_LOGITS, None, None, 0.0573,
    ),
    "scce.test_scalar_weighted": (
        keras.losses.SparseCategoricalCrossentropy(), [[0], [1], [2]], SCCE_PRED, 2.3, None, 0.7449,
    ),
    "scce.test_sample_weighted logits": (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        [[0], [1], [2]], SCCE_LOGITS, [1.2, 3.4, 5.6], None, 0.31829,
    ),
    "scce.test_ignore_class": (
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1),
        [[-1, 2]], [[[0.854, 0.698, 0.598], [0.088, 0.86, 0.018]]], None, None, 1.480129,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_keras_loss_case_evaluates_to_what_keras_asserts(case, tmp_path):
    loss, y_true, y_pred, sample_weight, mask, expected = CASES[case]
    found = evaluated({"loss": loss}, y_true, y_pred, sample_weight, mask, tmp_path)["loss"]
    assert found == pytest.approx(expected, abs=1e-3, rel=1e-5)


A_TRUE = [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]]
B_TRUE = [[0.7, 0.8], [0.9, 1.0], [1.1, 1.2]]
A_PRED = [[1.2, 1.1], [1.0, 0.9], [0.8, 0.7]]
B_PRED = [[0.6, 0.5], [0.4, 0.3], [0.2, 0.1]]
COMPILE_CASES = {  # compile_utils_test.CompileLossTest: (loss, y_true, y_pred, weights, value)
    "test_single_output_case": (
        keras.losses.MeanSquaredError(), A_TRUE, [[0.4, 0.1], [0.2, 0.6], [0.6, 0.1]], None,
        0.068333,
    ),
    "test_single_output_case_with_crossentropy_loss": (
        "crossentropy", A_TRUE, [[0.4, 0.1], [0.2, 0.6], [0.6, 0.1]], None, 0.706595,
    ),
    "test_list_output_case broadcast": ("mse", [A_TRUE, B_TRUE], [A_PRED, B_PRED], None, 0.953333),
    "test_list_output_case": (
        ["mse", "mse"], [A_TRUE, B_TRUE], [A_PRED, B_PRED], None, 0.953333,
    ),
    "test_dict_output_case broadcast": (
        "mse", {"a": A_TRUE, "b": B_TRUE}, {"a": A_PRED, "b": B_PRED},
        {"a": [1.0, 2.0, 3.0], "b": [3.0, 2.0, 1.0]}, 1.266666,
    ),
    "test_dict_output_case": (
        {"a": "mse", "b": "mse"}, {"a": A_TRUE, "b": B_TRUE}, {"a": A_PRED, "b": B_PRED},
        {"a": [1.0, 2.0, 3.0], "b": [3.0, 2.0, 1.0]}, 1.266666,
    ),
    "test_list_loss_dict_data": (
        {"b": "mse", "a": "mae"}, {"a": A_TRUE, "b": B_TRUE}, {"a": A_PRED, "b": B_PRED}, None,
        1.07666,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(COMPILE_CASES))
def test_a_compile_loss_case_evaluates_to_what_keras_asserts(case, tmp_path):
    """Keras's CompileLoss cases, one output or several, through the Estimator."""
    loss, y_true, y_pred, sample_weight, expected = COMPILE_CASES[case]
    if not isinstance(y_pred, dict) and not isinstance(y_pred[0][0], list):  # one output
        found = evaluated({"loss": loss}, y_true, y_pred, sample_weight, model_dir=tmp_path)["loss"]
    else:
        found = evaluated_outputs({"loss": loss}, y_true, y_pred, sample_weight, tmp_path)["loss"]
    assert found == pytest.approx(expected, abs=1e-5)
