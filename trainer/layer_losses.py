"""The losses a model's Keras layers add: weight regularizers and ``add_loss`` values.

Keras adds to a model's loss each trainable variable's ``regularizer`` (a kernel's L2)
and the values layers give ``add_loss`` during the forward pass (activity
regularizers, a VAE's KL term), summed as they are. Two things make the plain
``sum(layer.losses for layer in model_fn.layers)`` wrong for a ``ModelFn``, which is
not a Keras layer:

* a layer reachable twice (a Dense inside a Sequential that the ModelFn also holds
  as an attribute) would count its losses twice: here every layer and variable
  counts once;
* Keras forgets a layer's added losses whenever it is called from outside any layer,
  so a layer the ModelFn calls twice (siamese towers) would keep its last call's
  only: ``during_call`` runs the forward pass as one Keras call, as a functional
  model does, and keeps every call's values.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf
from absl import logging

from trainer import internals


@tf.autograph.experimental.do_not_convert
def unique_layers(layers: list[keras.layers.Layer]) -> list[keras.layers.Layer]:
    """Every layer in ``layers`` and inside them, each once."""
    found, seen = [], set()
    for top in layers:
        for layer in internals.sublayers(top):
            if id(layer) not in seen:
                seen.add(id(layer))
                found.append(layer)
    return found


@tf.autograph.experimental.do_not_convert
def own_adders(layers: list[keras.layers.Layer]) -> list[str]:
    """The names of the layers that last added losses of their own (not Keras's regularizers)."""
    return [
        layer.name
        for layer in unique_layers(layers)
        if internals.own_losses(layer) and getattr(layer, "activity_regularizer", None) is None
    ]


def say_how_cut_batches_take(adders: list[str]) -> None:
    """Says once how a batch cut in parts takes the layers' own ``add_loss`` values.

    Each part (micro-batch slice, tower, replica) is weighted by its share of the
    batch, as a mean is: exact for a mean over the examples (Keras's activity
    regularizers divide by the batch size), but a value summed over the batch would
    come out divided by the parts, and nothing tells the two apart.
    """
    if adders:
        logging.info(
            "Layers %s add losses of their own (add_loss); the batch is cut in parts, and "
            "each part's value is taken as a mean over its examples: a value summed over "
            "the batch would be divided by the number of parts (make it a mean: ops.mean)",
            ", ".join(map(repr, adders)),
        )


@tf.autograph.experimental.do_not_convert
def current(layers: list[keras.layers.Layer], variables: list) -> list[tf.Tensor]:
    """The losses the layers hold now: each layer's added values, each variable's penalty."""
    added = [loss for layer in unique_layers(layers) for loss in internals.own_losses(layer)]
    penalties = [v.regularizer(v) for v in variables if getattr(v, "regularizer", None)]
    return added + penalties


@contextlib.contextmanager
def during_call(layers: list[keras.layers.Layer], variables: list):
    """Yields a list that, after the block, holds the losses of the forward pass within.

    The layers' earlier values are forgotten first, so that each call (a micro-batch
    slice, a tower) counts its own.
    """
    for layer in layers:
        internals.clear_losses(layer)
    found: list[tf.Tensor] = []
    with internals.one_keras_call():
        yield found
    found.extend(current(layers, variables))


@tf.autograph.experimental.do_not_convert
def total(losses: list[tf.Tensor]) -> tf.Tensor:
    """The losses' sum as float32 (0 for none)."""
    return tf.add_n([tf.cast(loss, tf.float32) for loss in losses]) if losses else tf.constant(0.0)
