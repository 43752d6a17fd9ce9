"""A Keras model whose output is its input, for the ported tests of losses and metrics.

Keras's tests call a loss or a metric on a ``y_pred`` they write out. Here ``y_pred`` is
what a compiled model outputs when it is fed ``y_pred``, so the Estimator's evaluation
of the batches gives the number Keras's test asserts.
"""

import keras
import numpy as np
import tensorflow as tf

from trainer import Estimator


class MaskedBy(keras.layers.Layer):
    """``y_pred`` with ``mask`` set on it, as the tests' ``backend.set_keras_mask``."""

    def __init__(self):
        super().__init__()
        self.supports_masking = True

    def call(self, inputs):
        return inputs[0]

    def compute_mask(self, inputs, mask=None):
        return inputs[1]


def evaluated(compiled, y_true, y_pred, sample_weight=None, mask=None, model_dir=None, batch=None):
    """The Estimator's logs over ``y_pred`` (a model's output) and ``y_true``.

    ``compiled``: the keyword arguments of ``compile``. ``batch``: the examples a batch
    (all of them by default); Keras's tests that update a metric twice give both
    updates' rows, one batch after the other.
    """
    y_pred = np.asarray(y_pred, "float32")
    values = keras.Input(y_pred.shape[1:], name="values")
    if mask is None:
        model = keras.Model(values, keras.layers.Identity()(values))
        features = y_pred
    else:
        given = keras.Input(y_pred.shape[1:], dtype="bool", name="mask_given")
        model = keras.Model([values, given], MaskedBy()([values, given]))
        features = {"values": y_pred, "mask_given": np.asarray(mask)}
    model.compile("sgd", **compiled)
    batch = batch or len(y_pred)
    element = (features, np.asarray(y_true))
    if sample_weight is not None:
        weights = np.asarray(sample_weight, "float32")  # one for all, per example, per step
        element += (np.broadcast_to(weights, (len(y_pred),)) if weights.ndim < 2 else weights,)
    dataset = tf.data.Dataset.from_tensor_slices(element).batch(batch)
    estimator = Estimator(model, str(model_dir), eval_batch_size=batch, progress=False)
    return estimator.evaluate(lambda mode, params: dataset)


def evaluated_outputs(compiled, y_true, y_pred, sample_weight=None, model_dir=None, batch=None):
    """The Estimator's logs over several outputs (a list, or a dict by name), each
    passed through from the input of its name, with their labels as given."""
    names = sorted(y_pred) if isinstance(y_pred, dict) else ["a", "b"][: len(y_pred)]
    given = y_pred if isinstance(y_pred, dict) else dict(zip(names, y_pred, strict=True))
    inputs = {f"x_{n}": keras.Input(np.shape(given[n])[1:], name=f"x_{n}") for n in names}
    outputs = {n: keras.layers.Identity(name=n)(inputs[f"x_{n}"]) for n in names}
    if not isinstance(y_pred, dict):
        outputs = [outputs[n] for n in names]
    model = keras.Model(inputs, outputs)
    model.compile("sgd", **compiled)
    features = {f"x_{n}": np.asarray(given[n], "float32") for n in names}
    labels = (
        {n: np.asarray(v, "float32") for n, v in y_true.items()}
        if isinstance(y_true, dict)
        else tuple(np.asarray(v, "float32") for v in y_true)
    )
    element = (features, labels)
    if isinstance(sample_weight, dict):
        element += ({n: np.asarray(w, "float32") for n, w in sample_weight.items()},)
    elif sample_weight is not None:  # one weight an example, for every output
        element += (np.asarray(sample_weight, "float32"),)
    batch = batch or len(features[f"x_{names[0]}"])
    dataset = tf.data.Dataset.from_tensor_slices(element).batch(batch)
    estimator = Estimator(model, str(model_dir), eval_batch_size=batch, progress=False)
    return estimator.evaluate(lambda mode, params: dataset)
