"""ResNet (He et al. 2016): CIFAR's ResNet-20/32/44/56/110 and ImageNet's ResNet-18 to 152.

Two families, chosen by ``variant`` (by default by the depth: 18, 34, 50, 101 and 152
are ImageNet's, other depths CIFAR's):

* ``'cifar'`` (the paper's section 4.2): a 3x3 convolution of 16 filters, then three
  stages of ``n`` basic blocks (16, 32 and 64 filters, the last two halving the
  image), global average pooling and the logits: ``depth = 6n + 2`` layers. Its
  shortcuts are the paper's option A (identity; a stage that halves the image
  subsamples it and pads the new channels with zeros): ResNet-20 has 0.27M weights.
* ``'imagenet'``: the 7x7 stem with max pooling, four stages of basic (18, 34) or
  bottleneck (50, 101, 152) blocks with projection shortcuts where the shape
  changes, as ResNet v1.5 (torchvision's and TF's official one): a bottleneck
  block halves the image in its 3x3 convolution, not its first 1x1. ResNet-50 has
  25.6M weights and costs 4.1 GFLOPs (multiply-adds) per 224x224 image.

Both follow the recipes' details: batch norm after every convolution with a stated
momentum (0.9, as TF's and torchvision's ResNets: Keras's 0.99 trails for hundreds
of steps) and epsilon 1e-5; each block's last batch-norm scale starts at zero, so a
block starts as its shortcut (Goyal et al. 2017); He-normal convolutions; weight decay
on convolution and Dense kernels only, never on batch norm or biases.
"""

from __future__ import annotations

from collections.abc import Sequence

import gin
import keras
import tensorflow as tf

from models import heads
from trainer import Mode, ModelFn, UserError

VARIANTS = ("auto", "cifar", "imagenet")
IMAGENET_BLOCKS = {  # depth -> (blocks per stage, bottleneck)
    18: ((2, 2, 2, 2), False),
    34: ((3, 4, 6, 3), False),
    50: ((3, 4, 6, 3), True),
    101: ((3, 4, 23, 3), True),
    152: ((3, 8, 36, 3), True),
}


def stages(depth: int, variant: str) -> tuple[list[int], list[int], bool]:
    """``(blocks per stage, filters per stage, bottleneck)`` of a ResNet, or one line why not."""
    if variant == "auto":
        variant = "imagenet" if depth in IMAGENET_BLOCKS else "cifar"
    if variant == "cifar":
        if depth < 8 or (depth - 2) % 6:
            raise UserError(
                f"ResNet.depth = {depth} is not a CIFAR ResNet: its depth is 6n + 2 "
                "(20, 32, 44, 56, 110); for ImageNet's 18/34/50/101/152 set "
                "ResNet.variant = 'imagenet'"
            )
        n = (depth - 2) // 6
        return [n] * 3, [16, 32, 64], False
    if variant == "imagenet":
        if depth not in IMAGENET_BLOCKS:
            raise UserError(
                f"ResNet.depth = {depth} is not an ImageNet ResNet: use one of "
                f"{', '.join(map(str, IMAGENET_BLOCKS))} (or ResNet.variant = 'cifar' for 6n + 2)"
            )
        blocks, bottleneck = IMAGENET_BLOCKS[depth]
        return list(blocks), [64, 128, 256, 512], bottleneck
    raise UserError(f"ResNet.variant must be one of {', '.join(VARIANTS)}, got {variant!r}")


class _Norms:
    """Makes the model's convolutions and batch norms with one set of settings."""

    def __init__(self, momentum: float, epsilon: float, weight_decay: float, synchronized: bool):
        self.momentum, self.epsilon, self.synchronized = momentum, epsilon, synchronized
        # Keras's L2(l) adds l * sum(w^2) to the loss, whose gradient is 2 l w: a weight
        # decay of wd (the gradient wd * w, as the papers' SGD) is L2(wd / 2).
        self.regularizer = keras.regularizers.L2(weight_decay / 2) if weight_decay else None

    def conv(self, filters: int, kernel: int, strides: int, name: str) -> keras.layers.Conv2D:
        return keras.layers.Conv2D(
            filters,
            kernel,
            strides=strides,
            padding="same",
            use_bias=False,
            kernel_initializer="he_normal",
            kernel_regularizer=self.regularizer,
            name=name,
        )

    def norm(self, name: str, zero: bool = False) -> keras.layers.BatchNormalization:
        return keras.layers.BatchNormalization(
            momentum=self.momentum,
            epsilon=self.epsilon,
            gamma_initializer="zeros" if zero else "ones",
            synchronized=self.synchronized,
            name=name,
        )


class Block(keras.layers.Layer):
    """A residual block: ``relu(shortcut(x) + F(x))``, F of two 3x3 or three bottleneck convs.

    Args:
      filters: the block's width (a bottleneck block outputs 4x as many channels).
      strides: 2 when the block halves the image (in F's 3x3 convolution).
      bottleneck: 1x1, 3x3, 1x1 convolutions instead of two 3x3.
      shortcut: ``'identity'``, ``'pad'`` (option A: subsample, zero channels) or
        ``'projection'`` (a strided 1x1 convolution with batch norm).
      norms: the convolutions' and batch norms' settings.
      zero_init: start the last batch norm's scale at 0, so the block starts as its shortcut.
    """

    def __init__(
        self,
        filters: int,
        strides: int,
        bottleneck: bool,
        shortcut: str,
        norms: _Norms,
        zero_init: bool = True,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.strides, self.shortcut, self.filters = strides, shortcut, filters
        if bottleneck:
            widths, kernels, steps = [filters, filters, 4 * filters], [1, 3, 1], [1, strides, 1]
        else:
            widths, kernels, steps = [filters, filters], [3, 3], [strides, 1]
        self.depth = len(widths)
        for i, (width, kernel, step) in enumerate(zip(widths, kernels, steps, strict=True)):
            setattr(self, f"conv{i}", norms.conv(width, kernel, step, f"conv{i}"))
            last = i == len(widths) - 1
            setattr(self, f"bn{i}", norms.norm(f"bn{i}", zero=zero_init and last))
        if shortcut == "projection":
            self.project = norms.conv(widths[-1], 1, strides, "project")
            self.project_bn = norms.norm("project_bn")

    def call(self, x, training=False):
        """The block's output for ``x``; batch norm uses batch statistics in training only."""
        y = x
        for i in range(self.depth):
            y = getattr(self, f"bn{i}")(getattr(self, f"conv{i}")(y), training=training)
            if i < self.depth - 1:
                y = tf.nn.relu(y)
        return tf.nn.relu(self._shortcut(x, training) + y)

    def _shortcut(self, x, training):
        if self.shortcut == "projection":
            return self.project_bn(self.project(x), training=training)
        if self.shortcut == "pad":
            x = x[:, :: self.strides, :: self.strides, :]
            extra = self.filters - x.shape[-1]
            return tf.pad(x, [[0, 0], [0, 0], [0, 0], [extra // 2, extra - extra // 2]])
        return x


def _blocks(blocks, widths, bottleneck, channels, variant, norms, zero_init):
    """``(name, Block)`` of each block in order; the first of stages 2+ halves the image."""
    for s, (count, width) in enumerate(zip(blocks, widths, strict=True)):
        for b in range(count):
            strides = 2 if b == 0 and s > 0 else 1
            out = 4 * width if bottleneck else width
            if channels == out and strides == 1:
                shortcut = "identity"
            else:
                shortcut = "pad" if variant == "cifar" else "projection"
            name = f"stage{s + 1}_block{b + 1}"
            yield name, Block(width, strides, bottleneck, shortcut, norms, zero_init, name=name)
            channels = out


@gin.configurable
class ResNet(ModelFn):
    """A ResNet classifier of ``features[image_key]``; see the module docstring.

    Args:
      depth: layers with weights: 20, 32, 44, 56, 110 (``'cifar'``) or 18, 34, 50,
        101, 152 (``'imagenet'``).
      variant: ``'cifar'`` (16-32-64 filters, option A shortcuts), ``'imagenet'`` (the
        7x7 stem, 64-512 filters, v1.5 projection shortcuts) or ``'auto'``: ImageNet's
        for 18, 34, 50, 101 and 152, else CIFAR's (set ``'cifar'`` for CIFAR's 50 or 152).
      num_classes: size of the output layer.
      batch_norm_momentum: of the moving statistics (0.9; Keras's default is 0.99).
      batch_norm_epsilon: added to the variance (1e-5, as the reference ResNets).
      synchronized_batch_norm: normalise by the whole batch's statistics across a
        strategy's replicas (Keras's ``synchronized=True``): training then equals one
        device's; by default each replica normalises by its own share, as under
        Keras ``fit`` with a strategy (cheaper; the usual choice at 32+ per device).
      weight_decay: of the convolution and Dense kernels, as SGD's decay (1e-4).
      zero_init_residual: start each block's last batch-norm scale at 0.
      label_smoothing: mixes the loss's target with the uniform distribution (0.1 in
        ImageNet recipes), in training and evaluation as a Keras loss does; accuracy
        and the other metrics are scored against the labels as given.
      top_k_errors: report ``top_K_error`` for each K, e.g. ``[1, 5]`` for ImageNet.
      image_key: the feature to classify.
      label_key: the label holding class ids (or, after MixUp or CutMix, class
        probabilities).
    """

    def __init__(
        self,
        depth: int = 20,
        variant: str = "auto",
        num_classes: int = 10,
        batch_norm_momentum: float = 0.9,
        batch_norm_epsilon: float = 1e-5,
        synchronized_batch_norm: bool = False,
        weight_decay: float = 1e-4,
        zero_init_residual: bool = True,
        label_smoothing: float = 0.0,
        top_k_errors: Sequence[int] = (),
        image_key: str = "image",
        label_key: str = "label",
    ):
        super().__init__(name=f"resnet{depth}")
        self.depth = depth
        blocks, widths, bottleneck = stages(depth, variant)
        self.variant = "imagenet" if widths[0] == 64 else "cifar"
        self.image_key, self.label_key = image_key, label_key
        self.label_smoothing, self.top_k_errors = label_smoothing, list(top_k_errors)
        norms = _Norms(
            batch_norm_momentum, batch_norm_epsilon, weight_decay, synchronized_batch_norm
        )
        width, kernel, strides = (16, 3, 1) if self.variant == "cifar" else (64, 7, 2)
        self.stem = norms.conv(width, kernel, strides, "stem")
        self.stem_bn = norms.norm("stem_bn")
        self.block_names = []
        for name, block in _blocks(
            blocks, widths, bottleneck, width, self.variant, norms, zero_init_residual
        ):
            setattr(self, name, block)  # a named attribute: checkpoints see it
            self.block_names.append(name)
        self.logits = keras.layers.Dense(
            num_classes, kernel_regularizer=norms.regularizer, name="logits"
        )

    def __str__(self) -> str:
        """How the console names the model: ``ResNet-20``."""
        return f"ResNet-{self.depth}"

    def keras_model(self, input_shape: Sequence[int]) -> keras.Model:
        """The same network as a functional Keras model of this model's own layers.

        The two share their weights: what one trains, the other holds (Keras ``fit``
        of it is the parity tests' and the benchmark's reference). It takes images
        as they come, and gives the logits.
        """
        inputs = keras.Input(tuple(input_shape))
        x = keras.layers.ReLU()(self.stem_bn(self.stem(inputs)))
        if self.variant == "imagenet":
            x = keras.layers.MaxPooling2D(3, 2, padding="same")(x)
        for name in self.block_names:
            x = getattr(self, name)(x)
        logits = self.logits(keras.layers.GlobalAveragePooling2D()(x))
        return keras.Model(inputs, logits, name=f"resnet{self.depth}")

    def __call__(self, features, labels, mode):
        """Logits from the image; see ``heads.classification`` for the Spec."""
        training = mode == Mode.TRAIN
        x = tf.cast(features[self.image_key], tf.float32)
        x = tf.nn.relu(self.stem_bn(self.stem(x), training=training))
        if self.variant == "imagenet":
            x = tf.nn.max_pool2d(x, 3, 2, "SAME")
        activations = {"stem": x}
        for name in self.block_names:
            x = getattr(self, name)(x, training=training)
            activations[name] = x
        logits = self.logits(tf.reduce_mean(x, axis=[1, 2]))
        spec = heads.classification(
            logits,
            labels,
            self.label_key,
            self.top_k_errors,
            label_smoothing=self.label_smoothing,
        )
        spec.activations = {**activations, "logits": logits}
        return spec
