"""A small CNN as a Keras user writes one: a compiled ``keras.Sequential``.

The framework trains a compiled Keras model as it is (``trainer.KerasModel``): the
loss, metrics and optimizer given to ``compile()`` are the ones used. In gin::

    experiment.model_fn = @keras_cnn()
    keras_cnn.filters = 32
"""

from __future__ import annotations

from collections.abc import Sequence

import gin
import keras


@gin.configurable
def keras_cnn(
    input_shape: Sequence[int] = (8, 8, 1),
    num_classes: int = 10,
    filters: int = 16,
    dense_units: int = 64,
    learning_rate: float = 3e-3,
    input_name: str = "image",
) -> keras.Model:
    """A compiled CNN: two 3x3 convolutions, a hidden Dense layer, class logits.

    The last layer gives logits and the loss takes them (``from_logits=True``): the
    cross-entropy of a softmax's probabilities loses precision where a probability
    rounds to 0 or 1, which the log-softmax inside the loss does not (the numerically
    stable form the Effective TensorFlow guide teaches). ``keras.activations.softmax``
    of the output gives the probabilities; its argmax is the class either way.

    Args:
      input_shape: one example's image, height x width x channels.
      num_classes: size of the output layer; labels are class ids.
      filters: channels of the first convolution (the second has twice as many).
      dense_units: width of the hidden Dense layer.
      learning_rate: Adam's, given to ``compile``.
      input_name: the feature the model takes (``keras.Input``'s name).
    """
    model = keras.Sequential(
        [
            keras.Input(tuple(input_shape), name=input_name),
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(2 * filters, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(dense_units, activation="relu"),
            keras.layers.Dense(num_classes, name="logits"),
        ],
        name="keras_cnn",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model
