"""A multilayer perceptron classifier: flatten, hidden Dense layers, logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gin
import keras

from models import heads
from models.layers import DenseStack
from trainer import Mode, ModelFn


@gin.configurable
class MLP(ModelFn):
    """Flattens ``features[image_key]`` and classifies it with Dense layers.

    Args:
      num_classes: size of the output layer.
      hidden_units: width of each hidden layer, in order.
      activation: Keras activation name of the hidden layers, one or per layer.
      dropout_rate: dropout after each hidden layer (TRAIN only), one or per layer.
      batch_norm: batch normalisation in each hidden layer, one or per layer.
      l2: L2 weight decay on the hidden kernels, added to the training loss.
      image_key: the feature to classify.
      label_key: the label holding class ids.
    """

    def __init__(
        self,
        num_classes: int = 10,
        hidden_units: Sequence[int] = (512, 512),
        activation: Any = "relu",
        dropout_rate: Any = 0.0,
        batch_norm: Any = False,
        l2: float = 0.0,
        image_key: str = "image",
        label_key: str = "label",
    ):
        super().__init__(name="mlp")
        self.image_key, self.label_key = image_key, label_key
        self.flatten = keras.layers.Flatten(name="flatten")
        self.hidden = DenseStack(
            list(hidden_units),
            activation=activation,
            dropout=dropout_rate,
            batch_norm=batch_norm,
            l2=l2,
            name="dense",
        )
        self.logits = keras.layers.Dense(num_classes, name="logits")

    def __call__(self, features, labels, mode):
        """Logits from the image; see ``heads.classification`` for the Spec."""
        x = self.hidden(self.flatten(features[self.image_key]), training=mode == Mode.TRAIN)
        logits = self.logits(x)
        spec = heads.classification(logits, labels, self.label_key)
        spec.activations = {**self.hidden.outputs_by_block, "logits": logits}
        return spec
