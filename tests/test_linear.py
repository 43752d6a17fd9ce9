"""The diabetes data, and the normal-equation solution its experiments approach.

tests/test_as_written.py runs the two experiments and compares them with it.
"""

import numpy as np

from datasets import diabetes


def test_split_is_standardised_on_train():
    x, y = diabetes.arrays("train")
    assert x.shape == (353, 10) and diabetes.arrays("test")[0].shape == (89, 10)
    np.testing.assert_allclose(x.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(0), 1, atol=1e-5)
    assert 25 <= y.min() and y.max() <= 346
