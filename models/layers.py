"""Layer stacks with per-layer settings: the building blocks of the MLP and AlexNet.

Every per-layer setting takes either one value for all layers or a list with one
value per layer (``dropout=0.5`` or ``dropout=[0.0, 0.5]``). Dropout and batch norm
act on ``training`` (true in TRAIN only); batch-norm statistics move only then. Each
Keras layer runs under its own name scope, so TensorBoard's graph groups by layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from trainer import UserError


def per_layer(value: Any, count: int, what: str) -> list:
    """``value`` repeated ``count`` times, or the list itself if it has one per layer."""
    if isinstance(value, list | tuple):
        if len(value) != count:
            raise UserError(
                f"{what} has {len(value)} values for {count} layers: give one "
                f"value, or exactly {count}"
            )
        return list(value)
    return [value] * count


def _regularizer(l2: float):
    return keras.regularizers.L2(l2) if l2 else None


def _block(
    main: keras.layers.Layer,
    batch_norm: bool | float,
    activation,
    dropout: float,
    pool: keras.layers.Layer | None = None,
) -> list[keras.layers.Layer]:
    """``main``, then batch norm (optional), activation, pooling (optional), dropout (if > 0).

    ``batch_norm``: True for Keras's momentum (0.99), or the momentum itself (0.9).
    """
    block = [main]
    if batch_norm:
        momentum = 0.99 if batch_norm is True else float(batch_norm)
        block.append(keras.layers.BatchNormalization(momentum=momentum, name=f"{main.name}_bn"))
    block.append(keras.layers.Activation(activation, name=f"{main.name}_act"))
    if pool is not None:
        block.append(pool)
    if dropout:
        block.append(keras.layers.Dropout(dropout, name=f"{main.name}_dropout"))
    return block


class _Stack(keras.layers.Layer):
    """Runs its blocks of layers in order, passing ``training`` where used.

    Each layer is held as a named attribute: TensorFlow checkpoints do not see Keras
    layers kept in lists inside a Keras layer, so a list here would not be saved.
    """

    def _set_blocks(self, blocks: list[list[keras.layers.Layer]]) -> None:
        self._block_names = [[layer.name for layer in block] for block in blocks]
        for block in blocks:
            for layer in block:
                setattr(self, layer.name, layer)

    @property
    def blocks(self) -> list[list[keras.layers.Layer]]:
        """The layers, one list per block (Dense or Conv with its BN, activation, ...)."""
        return [[getattr(self, name) for name in names] for names in self._block_names]

    def call(self, x, training=False):
        """Applies each layer in order; ``self.outputs_by_block`` keeps each block's output."""
        self.outputs_by_block = {}
        for block in self.blocks:
            for layer in block:
                if isinstance(layer, keras.layers.Dropout | keras.layers.BatchNormalization):
                    x = layer(x, training=training)
                else:
                    x = layer(x)
            self.outputs_by_block[block[0].name] = x
        return x


class DenseStack(_Stack):
    """Dense layers, each followed by optional batch norm, the activation and dropout.

    Args:
      units: width of each layer (its length is the number of layers).
      activation: Keras activation name, one or per layer.
      dropout: dropout rate, one or per layer (0 for none).
      batch_norm: batch normalisation before the activation, one or per layer: True
        (Keras's momentum, 0.99), or its momentum (0.9 for a short run).
      l2: L2 weight-decay factor on the kernels (added to the training loss).
      name: prefix of the layers' names.
    """

    def __init__(
        self,
        units: Sequence[int],
        activation: Any = "relu",
        dropout: Any = 0.0,
        batch_norm: Any = False,
        l2: float = 0.0,
        name: str = "dense",
        **kwargs,
    ):
        super().__init__(name=name, **kwargs)
        count = len(units)
        activations = per_layer(activation, count, f"{name} activation")
        dropouts = per_layer(dropout, count, f"{name} dropout")
        norms = per_layer(batch_norm, count, f"{name} batch_norm")
        blocks = []
        for i in range(count):
            dense = keras.layers.Dense(
                units[i],
                use_bias=not norms[i],
                kernel_regularizer=_regularizer(l2),
                name=f"{name}_{i}",
            )
            blocks.append(_block(dense, norms[i], activations[i], dropouts[i]))
        self._set_blocks(blocks)


class ConvStack(_Stack):
    """Conv2D layers, each followed by optional batch norm, activation, pooling, dropout.

    Args:
      filters: output channels of each layer (its length is the number of layers).
      kernel_size: square kernel size, one or per layer.
      strides: convolution stride, one or per layer.
      pool_size: max-pooling window after the layer, one or per layer (0 or 1: none).
      pool_strides: pooling stride, one or per layer; None means the window size.
      activation: Keras activation name, one or per layer.
      dropout: dropout rate after each layer, one or per layer.
      batch_norm: batch normalisation before the activation, one or per layer: True
        (Keras's momentum, 0.99), or its momentum (0.9 for a short run).
      l2: L2 weight-decay factor on the kernels.
      padding: convolution padding, 'same' or 'valid'.
      pool_padding: pooling padding; 'valid' drops a trailing odd row and column.
      name: prefix of the layers' names.
    """

    def __init__(
        self,
        filters: Sequence[int],
        kernel_size: Any = 3,
        strides: Any = 1,
        pool_size: Any = 2,
        pool_strides: Any = None,
        activation: Any = "relu",
        dropout: Any = 0.0,
        batch_norm: Any = False,
        l2: float = 0.0,
        padding: str = "same",
        pool_padding: str = "valid",
        name: str = "conv",
        **kwargs,
    ):
        super().__init__(name=name, **kwargs)
        count = len(filters)
        kernels = per_layer(kernel_size, count, f"{name} kernel_size")
        conv_strides = per_layer(strides, count, f"{name} strides")
        pools = per_layer(pool_size, count, f"{name} pool_size")
        pool_steps = per_layer(pool_strides, count, f"{name} pool_strides")
        activations = per_layer(activation, count, f"{name} activation")
        dropouts = per_layer(dropout, count, f"{name} dropout")
        norms = per_layer(batch_norm, count, f"{name} batch_norm")
        blocks = []
        for i in range(count):
            conv = keras.layers.Conv2D(
                filters[i],
                kernels[i],
                strides=conv_strides[i],
                padding=padding,
                use_bias=not norms[i],
                kernel_regularizer=_regularizer(l2),
                name=f"{name}_{i}",
            )
            pool = None
            if pools[i] and pools[i] > 1:
                pool = keras.layers.MaxPooling2D(
                    pools[i], strides=pool_steps[i], padding=pool_padding, name=f"{name}_{i}_pool"
                )
            blocks.append(_block(conv, norms[i], activations[i], dropouts[i], pool))
        self._set_blocks(blocks)
