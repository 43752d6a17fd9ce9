"""Turns sources of single examples into an input_fn's batched dataset.

Two shapes of pipeline share one set of knobs, bound in gin under ``pipeline``:

* ``build``: single examples are mapped through a pure ``preprocess`` function,
  cached, shuffled and repeated (TRAIN), augmented, batched and prefetched;
* ``batched``: serialized records are cached, shuffled and batched first, then
  parsed a whole batch at a time (``tf.io.parse_example`` is vectorised).

TRAIN shuffles with ``params.seed``, repeats forever and drops the last partial
batch; EVAL and PREDICT read the data once and keep every example.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gin
import tensorflow as tf

from trainer import InputParams, Mode, UserError

Preprocess = Callable[[dict], tuple[dict, dict]]
Augment = Callable[[dict, dict, tf.Tensor], tuple[dict, dict]]


@gin.configurable("pipeline")
def options(
    cache: bool | str = True, shuffle_buffer: int = 10_000, deterministic: bool = True
) -> dict:
    """The pipeline knobs, as bound in gin (``pipeline.cache = '/tmp/cache/train'``).

    Args:
      cache: True keeps preprocessed examples in memory after the first epoch; a path
        caches them in files there (for data larger than memory); False: no cache.
      shuffle_buffer: training shuffle buffer, in examples.
      deterministic: keep the element order reproducible; False lets parallel stages
        deliver out of order, for speed.
    """
    return dict(cache=cache, shuffle_buffer=shuffle_buffer, deterministic=deterministic)


def build(
    source: tf.data.Dataset | Sequence[tf.data.Dataset],
    mode: Mode,
    params: InputParams,
    preprocess: Preprocess,
    *,
    augment: Augment | None = None,
    weights: Sequence[float] | None = None,
    name: str = "data",
) -> tf.data.Dataset:
    """The batched ``(features, labels)`` dataset for ``mode`` from single examples.

    Args:
      source: single examples, or a list of sources (e.g. several splits).
      mode: the mode the input_fn was called for.
      params: batch size, seed and this pipeline's shard.
      preprocess: pure function of one example to ``(features, labels)``.
      augment: ``augment(features, labels, seed)`` applied in TRAIN only, after the
        cache, so each epoch sees new draws. ``seed`` is a shape-[2] int64 tensor for
        ``tf.image.stateless_random_*`` ops, drawn from a seeded ``Dataset.random``, so
        augmentation is reproducible and checkpointed with the input position.
      weights: with several sources, the probability of drawing from each in TRAIN
        (default: equal); EVAL and PREDICT read them one after the other.
      name: names the cache files when ``pipeline.cache`` is a path (e.g. the split).
    """
    knobs = options()
    _check_batch(params)
    sources = list(source) if isinstance(source, list | tuple) else [source]
    training = mode == Mode.TRAIN

    def prepare(dataset, index):
        if params.num_input_pipelines > 1:
            dataset = dataset.shard(params.num_input_pipelines, params.input_pipeline_id)
        dataset = dataset.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
        dataset = _cache(dataset, knobs["cache"], f"{name}-{index}")
        if training:
            dataset = dataset.shuffle(knobs["shuffle_buffer"], seed=params.seed)
            dataset = dataset.repeat()
        return dataset

    prepared = [prepare(dataset, i) for i, dataset in enumerate(sources)]
    if len(prepared) == 1:
        dataset = prepared[0]
    elif training:
        if weights is not None and len(weights) != len(prepared):
            raise UserError(f"{len(weights)} mixing weights for {len(prepared)} sources")
        dataset = tf.data.Dataset.sample_from_datasets(prepared, weights=weights, seed=params.seed)
    else:
        dataset = prepared[0]
        for other in prepared[1:]:
            dataset = dataset.concatenate(other)
    if training and augment is not None:
        dataset = _with_seeds(dataset, params.seed).map(
            lambda element, seed: augment(*element, seed), num_parallel_calls=tf.data.AUTOTUNE
        )
    dataset = dataset.batch(params.batch_size, drop_remainder=training)
    return _finish(dataset, knobs)


def batched(
    records: tf.data.Dataset,
    mode: Mode,
    params: InputParams,
    parse: Callable[[tf.Tensor], tuple[dict, dict]],
    *,
    augment: Augment | None = None,
    name: str = "data",
) -> tf.data.Dataset:
    """The batched ``(features, labels)`` dataset from serialized records.

    Records are cached and shuffled serialized; each batch is parsed with one call of
    ``parse`` (vectorised); ``augment(features, labels, seed)`` then acts on whole
    batches in TRAIN. ``name`` names the cache files when ``pipeline.cache`` is a path.
    """
    knobs = options()
    _check_batch(params)
    training = mode == Mode.TRAIN
    dataset = _cache(records, knobs["cache"], name)
    if training:
        dataset = dataset.shuffle(knobs["shuffle_buffer"], seed=params.seed).repeat()
    dataset = dataset.batch(params.batch_size, drop_remainder=training)
    dataset = dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    if training and augment is not None:
        dataset = _with_seeds(dataset, params.seed).map(
            lambda element, seed: augment(*element, seed), num_parallel_calls=tf.data.AUTOTUNE
        )
    return _finish(dataset, knobs)


def _check_batch(params: InputParams) -> None:
    if params.batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {params.batch_size}")


def _cache(dataset: tf.data.Dataset, cache: bool | str, name: str) -> tf.data.Dataset:
    if cache is True:
        return dataset.cache()
    if isinstance(cache, str) and cache:
        tf.io.gfile.makedirs(cache)
        return dataset.cache(f"{cache.rstrip('/')}/{name.replace('/', '_')}")
    return dataset


def _with_seeds(dataset: tf.data.Dataset, seed: int | None) -> tf.data.Dataset:
    """Pairs each element with a fresh shape-[2] seed for stateless random ops."""
    return tf.data.Dataset.zip((dataset, tf.data.Dataset.random(seed=seed).batch(2)))


def _finish(dataset: tf.data.Dataset, knobs: dict) -> tf.data.Dataset:
    dataset_options = tf.data.Options()
    dataset_options.deterministic = knobs["deterministic"]
    return dataset.with_options(dataset_options).prefetch(tf.data.AUTOTUNE)
