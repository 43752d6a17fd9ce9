"""Turns a source of single examples into an input_fn's dataset.

A source is a ``tf.data.Dataset`` of single examples (dicts of tensors). ``build``
maps a pure ``preprocess`` function over it and adds what every input_fn needs:
sharding across input pipelines, caching, shuffling and repeating for training,
batching (eval never drops an example), and prefetching.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from trainer import InputParams, Mode, UserError

Preprocess = Callable[[dict], tuple[dict, dict]]
Augment = Callable[[dict, dict, tf.Tensor], tuple[dict, dict]]


def build(
    source: tf.data.Dataset,
    mode: Mode,
    params: InputParams,
    preprocess: Preprocess,
    *,
    augment: Augment | None = None,
    shuffle_buffer: int = 10_000,
    cache: bool = True,
    deterministic: bool = True,
) -> tf.data.Dataset:
    """The batched ``(features, labels)`` dataset for ``mode``.

    Args:
      source: single examples.
      mode: TRAIN shuffles (seeded by ``params.seed``), repeats forever and drops the
        last partial batch; EVAL and PREDICT go through the data once, keeping it.
      params: batch size, seed and this pipeline's shard.
      preprocess: pure function of one example to ``(features, labels)``.
      augment: ``augment(features, labels, seed)`` applied in TRAIN only, after the
        cache, so each epoch sees new draws. ``seed`` is a shape-[2] int64 tensor for
        ``tf.image.stateless_random_*`` ops, drawn from a seeded ``Dataset.random``, so
        augmentation is reproducible and checkpointed with the input position.
      shuffle_buffer: examples in the shuffle buffer (training only).
      cache: keep preprocessed examples in memory after the first epoch.
      deterministic: keep the element order reproducible; False trades it for speed.

    Returns:
      A dataset of ``(features, labels)`` batches.
    """
    if params.batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {params.batch_size}")
    dataset = source
    if params.num_input_pipelines > 1:
        dataset = dataset.shard(params.num_input_pipelines, params.input_pipeline_id)
    dataset = dataset.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
    if cache:
        dataset = dataset.cache()
    training = mode == Mode.TRAIN
    if training:
        dataset = dataset.shuffle(shuffle_buffer, seed=params.seed, reshuffle_each_iteration=True)
        dataset = dataset.repeat()
        if augment is not None:
            seeds = tf.data.Dataset.random(seed=params.seed).batch(2)
            dataset = tf.data.Dataset.zip((dataset, seeds)).map(
                lambda element, seed: augment(*element, seed), num_parallel_calls=tf.data.AUTOTUNE
            )
    dataset = dataset.batch(params.batch_size, drop_remainder=training)
    options = tf.data.Options()
    options.deterministic = deterministic
    return dataset.with_options(options).prefetch(tf.data.AUTOTUNE)
