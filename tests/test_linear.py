"""Linear regression on the diabetes data approaches the normal-equation solution."""

import json

import numpy as np
import pytest

from datasets import diabetes
from tests.conftest import run_cli


def closed_form_eval_mse():
    x, y = diabetes.arrays("train")
    design = np.c_[x, np.ones(len(x))]
    theta = np.linalg.solve(design.T @ design, design.T @ y)  # (X^T X)^-1 X^T y
    x_test, y_test = diabetes.arrays("test")
    return float(np.mean((np.c_[x_test, np.ones(len(x_test))] @ theta - y_test) ** 2))


def test_split_is_standardised_on_train():
    x, y = diabetes.arrays("train")
    assert x.shape == (353, 10) and diabetes.arrays("test")[0].shape == (89, 10)
    np.testing.assert_allclose(x.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(0), 1, atol=1e-5)
    assert 25 <= y.min() and y.max() <= 346


@pytest.mark.parametrize("experiment", ["diabetes_linear", "diabetes_linear_momentum"])
def test_gradient_descent_reaches_the_closed_form(tmp_path, experiment):
    results = tmp_path / "r.json"
    proc = run_cli(
        "--gin_file",
        f"experiments/{experiment}.gin",
        "--model_dir",
        str(tmp_path / "run"),
        "--results",
        str(results),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    mse = json.loads(results.read_text())["metrics"]["eval"]["mse"]
    assert mse == pytest.approx(closed_form_eval_mse(), rel=0.01)
