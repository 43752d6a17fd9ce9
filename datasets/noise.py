"""Gaussian noise as a feature, for generative models: a GAN's latent input.

Each example's noise is drawn from a seed made of the run's seed and the example's
place in the training stream (stateless ops; the place ``datasets.order`` gives the
positions a datasets/ pipeline reads), so it is the same however the stream is cut
into batches: on one device, on towers, on a strategy's replicas and workers; and a
resumed run draws what an uninterrupted one would. Evaluation draws the same noise at
every evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import gin
import tensorflow as tf

from datasets.order import pipeline_positions
from trainer import InputParams, Mode
from trainer.model_fn import counted, is_positioned, num_examples, positioned

_EVAL_STREAM = 1 << 40  # eval batches draw from seeds no training batch uses


@gin.configurable(module="noise")
def input_fn(
    mode: Mode,
    params: InputParams,
    input_fn: Callable = gin.REQUIRED,
    dim: int = 32,
    key: str = "noise",
    uniform_key: str | None = None,
) -> tf.data.Dataset:
    """``input_fn``'s batches with ``features[key]``: float32 ``[batch, dim]`` noise.

    Args:
      mode: the mode asked for.
      params: from the framework: the seed, the stream position, this pipeline.
      input_fn: the input_fn whose features gain the noise (``@digits.input_fn``).
      dim: the noise's size per example.
      key: the feature's name.
      uniform_key: also a feature of one number in [0, 1) per example, drawn with the
        noise but independent of it (where WGAN-GP puts its point between a real and
        a generated image); None for none.
    """
    dataset = input_fn(mode, params)
    if not (mode == Mode.TRAIN and is_positioned(dataset)):  # resumed by its iterator
        params = dataclasses.replace(params, start_example=0)
    seed = tf.constant(params.seed or 0, tf.int64)

    def with_noise(index, element):
        features, *rest = element if isinstance(element, tuple) else (element,)
        batch = tf.shape(tf.nest.flatten(features)[0], out_type=tf.int64)[0]
        elements = index * params.batch_size + tf.range(batch, dtype=tf.int64)  # its own
        if mode == Mode.TRAIN:  # where they stand in the stream of every pipeline
            places = pipeline_positions(elements, params)
        else:  # every worker reads the whole eval set (the framework shares it out)
            places = _EVAL_STREAM + elements
        seeds = tf.stack([tf.fill([batch], seed), places], axis=1)
        draws = dim + (uniform_key is not None)
        drawn = tf.map_fn(functools.partial(_draw, draws), seeds, fn_output_signature=tf.float32)
        features = {**features, key: drawn[:, :dim]}
        if uniform_key is not None:  # a standard normal's CDF at it is uniform in [0, 1)
            features[uniform_key] = 0.5 * (1.0 + tf.math.erf(drawn[:, dim] / math.sqrt(2.0)))
        return (features, *rest) if rest else features

    noisy = dataset.enumerate().map(with_noise, num_parallel_calls=tf.data.AUTOTUNE)
    noisy = noisy.prefetch(tf.data.AUTOTUNE)
    if is_positioned(dataset):
        noisy = positioned(noisy)
    if num_examples(dataset) is not None:
        noisy = counted(noisy, num_examples(dataset))
    return noisy


@tf.autograph.experimental.do_not_convert
def _draw(dim: int, seed: tf.Tensor) -> tf.Tensor:
    """One example's noise, from its own seed."""
    return tf.random.stateless_normal([dim], seed=seed)
