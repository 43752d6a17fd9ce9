"""Linear regression, optionally on polynomial features: y = w . [x, x^2, ...] + b."""

from __future__ import annotations

import gin
import keras
import tensorflow as tf

from trainer import ModelFn, Spec


@gin.configurable
class LinearRegression(ModelFn):
    """Least squares on ``features[feature_key]`` (shape ``[batch, d]``) and its powers.

    Args:
      degree: highest power of each feature (1: plain linear regression).
      feature_key: the input feature.
      label_key: the regression target.
    """

    def __init__(self, degree: int = 1, feature_key: str = "x", label_key: str = "y"):
        super().__init__(name="linear")
        self.degree, self.feature_key, self.label_key = degree, feature_key, label_key
        self.dense = keras.layers.Dense(1, kernel_initializer="zeros", name="dense")

    def __call__(self, features, labels, mode):
        """Prediction ``y``; loss and ``mse`` are squared error, ``mae`` absolute error."""
        x = tf.cast(features[self.feature_key], tf.float32)
        powers = tf.concat([x**p for p in range(1, self.degree + 1)], axis=-1)
        y = self.dense(powers)[:, 0]
        if labels is None:
            return Spec({"y": y})
        error = y - tf.cast(labels[self.label_key], tf.float32)
        return Spec(
            {"y": y}, loss=tf.reduce_mean(error**2), metrics={"mse": error**2, "mae": tf.abs(error)}
        )
