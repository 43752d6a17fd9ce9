"""A multilayer perceptron classifier: flatten, hidden Dense layers, logits."""

from __future__ import annotations

from collections.abc import Sequence

import gin
import keras

from models import heads
from trainer import Mode, ModelFn


@gin.configurable
class MLP(ModelFn):
    """Flattens ``features[image_key]`` and classifies it with Dense layers.

    Args:
      num_classes: size of the output layer.
      hidden_units: width of each hidden layer, in order.
      activation: Keras activation name of the hidden layers.
      dropout_rate: dropout after each hidden layer, active in TRAIN only.
      image_key: the feature to classify.
      label_key: the label holding class ids.
    """

    def __init__(
        self,
        num_classes: int = 10,
        hidden_units: Sequence[int] = (512, 512),
        activation: str = "relu",
        dropout_rate: float = 0.0,
        image_key: str = "image",
        label_key: str = "label",
    ):
        super().__init__(name="mlp")
        self.image_key, self.label_key = image_key, label_key
        self.flatten = keras.layers.Flatten(name="flatten")
        self.hidden = [
            keras.layers.Dense(units, activation=activation, name=f"dense_{i}")
            for i, units in enumerate(hidden_units)
        ]
        self.dropout = [
            keras.layers.Dropout(dropout_rate, name=f"dropout_{i}")
            for i in range(len(hidden_units))
        ]
        self.logits = keras.layers.Dense(num_classes, name="logits")

    def __call__(self, features, labels, mode):
        """Logits from the image; see ``heads.classification`` for the Spec."""
        training = mode == Mode.TRAIN
        x = self.flatten(features[self.image_key])
        for dense, dropout in zip(self.hidden, self.dropout, strict=False):
            x = dropout(dense(x), training=training)
        return heads.classification(self.logits(x), labels, self.label_key)
