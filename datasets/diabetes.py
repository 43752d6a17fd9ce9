"""scikit-learn's diabetes data (442 patients, 10 features): regression, offline.

Fixed split: the rows are permuted with ``numpy.random.RandomState(0)``; the first
353 (80%) are ``train``, the other 89 ``test``. Features are held in their units and
standardised in the pipeline with the training split's mean and standard deviation;
the target (disease progression after one year, 25-346) is kept in its units, so MSE
reads in those units squared.
"""

from __future__ import annotations

import functools

import gin
import numpy as np
import tensorflow as tf

from datasets import pipeline
from trainer import InputParams, Mode
from trainer.serving import serves

NUM_EXAMPLES = 442
NUM_TRAIN = 353


def raw(split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x [n, 10] float32 in the data's units, y [n] float32)`` of 'train' or 'test'."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True, scaled=False)
    order = np.random.RandomState(0).permutation(NUM_EXAMPLES)
    rows = {"train": order[:NUM_TRAIN], "test": order[NUM_TRAIN:]}[split]
    return x[rows].astype(np.float32), y[rows].astype(np.float32)


@functools.lru_cache(maxsize=1)
def _training_statistics() -> tuple[np.ndarray, np.ndarray]:
    x, _ = raw("train")
    return x.mean(0), x.std(0)


@tf.autograph.experimental.do_not_convert
def features_of(stored: dict) -> dict:
    """The model's features of stored ones (an example or a batch): ``x`` standardised.

    By the training split's mean and deviation. Training maps it over the rows, and
    an export applies it to what a client sends (``trainer.serves``).
    """
    mean, std = _training_statistics()
    return {"x": (tf.convert_to_tensor(stored["x"], tf.float32) - mean) / std}


def arrays(split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x [n, 10] standardised float32, y [n] float32)`` of 'train' or 'test'."""
    x, y = raw(split)
    return features_of({"x": x})["x"].numpy(), y


@gin.configurable
def input_fn(mode: Mode, params: InputParams, split: str | None = None) -> tf.data.Dataset:
    """Batches of ``({'x': [batch, 10]}, {'y': [batch]})``: 'train' for TRAIN, else 'test'.

    ``features['x']``: float32 ``[batch, 10]``, the ten baseline variables (age, sex,
    BMI, blood pressure, six blood serum measurements) standardised on the training
    split (mean 0, deviation 1); ``labels['y']``: float32 ``[batch]``, disease
    progression one year later, 25..346. 353 training and 89 test examples. An export
    takes the ten variables in their own units (``serving_default``'s ``x``).
    """
    split = split or ("train" if mode == Mode.TRAIN else "test")
    x, y = raw(split)
    source = pipeline.ArraySource({"x": x, "y": y}, name=f"diabetes {split}")
    dataset = pipeline.build(
        source, mode, params, lambda e: (features_of(e), {"y": e["y"]}), name=f"diabetes-{split}"
    )
    return serves(dataset, features_of, {"x": tf.TensorSpec([10], tf.float32)})
