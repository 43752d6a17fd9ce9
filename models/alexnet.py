"""AlexNet: a stack of convolutions with pooling, then Dense layers, for any image size.

The defaults are the framework's small AlexNet (conv 64-128-256, 3x3 kernels, 2x2
max pooling that halves the image each time, Dense 512, dropout 0.5), which trains
on 28x28x1, 32x32x3 or digits resized to 32x32. The classic ImageNet AlexNet is the
same class with other bindings: see experiments/alexnet_imagenet.gin.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gin
import keras
import tensorflow as tf

from models import heads
from models.layers import ConvStack, DenseStack
from trainer import Mode, ModelFn


@gin.configurable
class AlexNet(ModelFn):
    """Conv stack, flatten, Dense stack, logits.

    Args:
      num_classes: size of the output layer.
      conv_filters: output channels of each convolution.
      kernel_size: kernel size, one or per convolution.
      strides: convolution strides, one or per convolution.
      pool_size: max-pool window after each convolution (0: none), one or per layer.
      pool_strides: pooling strides; None means the window size (no overlap).
      dense_units: widths of the hidden Dense layers.
      dropout_rate: dropout after each hidden Dense layer (TRAIN only).
      batch_norm: batch normalisation in every conv and Dense layer: True (Keras's
        momentum, 0.99: its moving statistics trail for hundreds of steps, and the model
        evaluates near chance until then, as under Keras fit) or the momentum (0.9).
      l2: L2 weight decay on all kernels.
      resize_to: resize images to this (height, width) first, e.g. (32, 32) for digits.
      top_k_errors: report ``top_K_error`` for each K, e.g. ``[1, 5]`` for ImageNet.
      image_key: the feature to classify.
      label_key: the label holding class ids.
    """

    def __init__(
        self,
        num_classes: int = 10,
        conv_filters: Sequence[int] = (64, 128, 256),
        kernel_size: Any = 3,
        strides: Any = 1,
        pool_size: Any = 2,
        pool_strides: Any = None,
        dense_units: Sequence[int] = (512,),
        dropout_rate: Any = 0.5,
        batch_norm: bool | float = False,
        l2: float = 0.0,
        resize_to: Sequence[int] | None = None,
        top_k_errors: Sequence[int] = (),
        image_key: str = "image",
        label_key: str = "label",
    ):
        super().__init__(name="alexnet")
        self.image_key, self.label_key = image_key, label_key
        self.resize_to = list(resize_to) if resize_to else None
        self.top_k_errors = list(top_k_errors)
        self.convs = ConvStack(
            list(conv_filters),
            kernel_size=kernel_size,
            strides=strides,
            pool_size=pool_size,
            pool_strides=pool_strides,
            batch_norm=batch_norm,
            l2=l2,
            name="conv",
        )
        self.flatten = keras.layers.Flatten(name="flatten")
        self.dense = DenseStack(
            list(dense_units), dropout=dropout_rate, batch_norm=batch_norm, l2=l2, name="dense"
        )
        self.logits = keras.layers.Dense(num_classes, name="logits")

    def __call__(self, features, labels, mode):
        """Logits from the image; see ``heads.classification`` for the Spec."""
        training = mode == Mode.TRAIN
        image = tf.cast(features[self.image_key], tf.float32)
        if self.resize_to:
            image = tf.image.resize(image, self.resize_to)
        x = self.flatten(self.convs(image, training=training))
        x = self.dense(x, training=training)
        logits = self.logits(x)
        spec = heads.classification(logits, labels, self.label_key, self.top_k_errors)
        spec.activations = {
            **self.convs.outputs_by_block,
            **self.dense.outputs_by_block,
            "logits": logits,
        }
        return spec
