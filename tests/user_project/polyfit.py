"""A research user's own module: fit y = 5x^2 + 3 from noisy samples."""

import gin
import keras
import numpy as np
import tensorflow as tf

import trainer


@gin.configurable
def polynomial_data(mode, params, num_examples=1000, noise=0.1):
    """Samples x in [-1, 1] and y = 5x^2 + 3 + noise; PREDICT gets x only."""
    if mode == trainer.Mode.PREDICT:
        x = np.array([[0.0], [0.5], [1.0]], dtype="float32")
        return tf.data.Dataset.from_tensor_slices({"x": x}).batch(params.batch_size)
    rng = np.random.default_rng(0 if mode == trainer.Mode.TRAIN else 1)
    x = rng.uniform(-1, 1, size=(num_examples, 1)).astype("float32")
    y = (5 * x**2 + 3 + noise * rng.normal(size=x.shape)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, {"y": y}))
    if mode == trainer.Mode.TRAIN:
        dataset = dataset.shuffle(num_examples, seed=params.seed).repeat()
    return dataset.batch(params.batch_size)


@gin.configurable
class PolynomialFit(trainer.ModelFn):
    """y = w . [x, x^2, ..., x^degree] + b."""

    def __init__(self, degree=2):
        super().__init__()
        self.degree = degree
        self.dense = keras.layers.Dense(1)

    def __call__(self, features, labels, mode):
        x = features["x"]
        powers = tf.concat([x**p for p in range(1, self.degree + 1)], axis=-1)
        y = self.dense(powers)
        if labels is None:  # PREDICT: no labels, no loss
            return trainer.Spec(predictions={"y": y})
        error = y - labels["y"]
        return trainer.Spec(
            predictions={"y": y},
            loss=tf.reduce_mean(error**2),
            metrics={"abs_error": tf.abs(error[:, 0])},
        )
