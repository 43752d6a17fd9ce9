"""scikit-learn's diabetes data (442 patients, 10 features): regression, offline.

Fixed split: the rows are permuted with ``numpy.random.RandomState(0)``; the first
353 (80%) are ``train``, the other 89 ``test``. Features are standardised with the
training split's mean and standard deviation; the target (disease progression after
one year, 25-346) is kept in its units, so MSE reads in those units squared.
"""

from __future__ import annotations

import gin
import numpy as np
import tensorflow as tf

from datasets import pipeline
from trainer import InputParams, Mode

NUM_EXAMPLES = 442
NUM_TRAIN = 353


def arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x [n, 10] standardised float32, y [n] float32)`` of 'train' or 'test'."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True, scaled=False)
    order = np.random.RandomState(0).permutation(NUM_EXAMPLES)
    train, test = order[:NUM_TRAIN], order[NUM_TRAIN:]
    mean, std = x[train].mean(0), x[train].std(0)
    rows = {"train": train, "test": test}[split]
    return ((x[rows] - mean) / std).astype(np.float32), y[rows].astype(np.float32)


@gin.configurable
def input_fn(mode: Mode, params: InputParams, split: str | None = None) -> tf.data.Dataset:
    """Batches of ``({'x': [batch, 10]}, {'y': [batch]})``: 'train' for TRAIN, else 'test'.

    ``features['x']``: float32 ``[batch, 10]``, the ten baseline variables (age, sex,
    BMI, blood pressure, six blood serum measurements) standardised on the training
    split (mean 0, deviation 1); ``labels['y']``: float32 ``[batch]``, disease
    progression one year later, 25..346. 353 training and 89 test examples.
    """
    split = split or ("train" if mode == Mode.TRAIN else "test")
    x, y = arrays(split)
    source = pipeline.ArraySource({"x": x, "y": y}, name=f"diabetes {split}")
    return pipeline.build(
        source, mode, params, lambda e: ({"x": e["x"]}, {"y": e["y"]}), name=f"diabetes-{split}"
    )
