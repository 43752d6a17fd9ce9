"""Turns sources of single examples into an input_fn's batched dataset.

Training reads its sources **by index** (``datasets/order.py``): position ``p`` of
the training stream is a pure function of ``(seed, p)``, each epoch a full
permutation of the data. Checkpoints then hold no input state but the number of
examples read, and a resumed run starts at the exact next example, on any number of
devices or workers, in constant time. A source is read by index when it allows it:

* ``ArraySource``: examples in memory (digits, diabetes, a user's numpy arrays);
* a ``tf.data.Dataset`` of fixed-shape examples whose decoded size fits
  ``pipeline.memory_limit_mb``: read once into memory, then by index;
* ``RecordExamples``: serialized records read by index from files, for data
  larger than memory: TFRecord shards with their index (``datasets/records/tfrecord.py``),
  TFDS datasets prepared as ArrayRecord (``datasets/tfds_images.py``).

A ``tf.data`` source that is too large or of varying shapes is read sequentially
with a shuffle buffer instead (the pre-index path): its iterator, buffer included,
is then what a checkpoint saves, and the log says so.

Two shapes of pipeline share one set of knobs, bound in gin under ``pipeline``:

* ``build``: single examples go through a pure ``preprocess`` and, in TRAIN,
  ``augment``, then are batched;
* ``batched``: serialized records are batched first and parsed a whole batch at a
  time (``tf.io.parse_example`` is vectorised).

TRAIN repeats forever and drops a last partial batch; EVAL and PREDICT read the
data once, in order, and keep every example. Augmentation draws its randomness from
``(seed, position)``, so it needs no saved RNG state either.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import gin
import numpy as np
import tensorflow as tf
from absl import logging

from datasets import batching, lengths, mixing, packing, token_budget
from datasets.lengths import padded
from datasets.order import Order, pipeline_positions, replica_shares
from datasets.sources import (  # noqa: F401 - users name them pipeline.ArraySource, ...
    ArraySource,
    Preprocess,
    RandomAccess,
    Reader,
    RecordExamples,
    concat,
    fixed_shapes,
    in_memory,
    memory_limit,
    reader_of,
)
from trainer import InputParams, Mode, UserError
from trainer.model_fn import counted, positioned, sized_by

Augment = Callable[[dict, dict, tf.Tensor], tuple[dict, dict]]


@gin.configurable("pipeline")
def options(
    cache: bool | str = "auto",
    memory_limit_mb: float | None = None,
    shuffle_buffer: int = 10_000,
    deterministic: bool = True,
) -> dict:
    """The pipeline knobs, as bound in gin (``pipeline.cache = False``).

    Args:
      cache: how a ``tf.data`` source is held. ``'auto'``: in memory (and read by
        index) when its decoded examples fit ``memory_limit_mb``, else read in
        sequence; True: in memory whatever its size; False: never in memory; a path:
        read in sequence, caching the preprocessed examples in files there.
      memory_limit_mb: the most memory one source may take in memory; default a
        quarter of this machine's RAM, at most 16 GiB.
      shuffle_buffer: shuffle buffer, in examples, of a source read in sequence.
      deterministic: keep the element order reproducible; False lets parallel stages
        deliver out of order, for speed (training order then is not exact on resume).
    """
    return dict(
        cache=cache,
        memory_limit_mb=memory_limit_mb,
        shuffle_buffer=shuffle_buffer,
        deterministic=deterministic,
    )


def build(
    source: ArraySource | tf.data.Dataset | Sequence[ArraySource | tf.data.Dataset],
    mode: Mode,
    params: InputParams,
    preprocess: Preprocess,
    *,
    augment: Augment | None = None,
    weights: Sequence[float] | None = None,
    name: str = "data",
    by_index_fix: str | None = None,
) -> tf.data.Dataset:
    """The batched ``(features, labels)`` dataset for ``mode`` from single examples.

    Args:
      source: an ``ArraySource``, a ``RecordExamples``, a ``tf.data.Dataset`` of
        single examples, or a list of them (e.g. several splits).
      mode: the mode the input_fn was called for.
      params: batch size, seed, this pipeline's shard and, in TRAIN, where to start.
      preprocess: pure function of one example to ``(features, labels)``.
      augment: ``augment(features, labels, seed)`` applied in TRAIN only, to each
        example of each epoch anew. ``seed`` is a shape-[2] int64 tensor for
        ``tf.image.stateless_random_*`` ops, derived from (run seed, stream position).
      weights: with several sources, the share of the training stream each gets
        (default: equal); EVAL and PREDICT read them one after the other.
      name: names the source in the log, and the cache files when
        ``pipeline.cache`` is a path.
      by_index_fix: how this source could be read by index, for the warning when it
        must be read in sequence.
    """
    training = mode == Mode.TRAIN
    made = batching.read(options(), name, augmented=training and augment is not None)
    _check_batch(params)
    sources = list(source) if isinstance(source, list | tuple) else [source]
    if training:
        Order([1] * len(sources), weights)  # bad weights are refused before any reading
    held = [in_memory(s, f"{name}-{i}", made.pipeline) for i, s in enumerate(sources)]
    held = _alike(held, sources)
    reasons = [h for h in held if isinstance(h, str)]
    if reasons:  # some source cannot be read by index
        lengths.check(made.lengths, None, name, len(sources))
        if made.packing.active:
            packing.check(made.packing, None, name)
        if training:
            _log_sequential(name, reasons[0], by_index_fix)
        return _sequential(sources, mode, params, preprocess, augment, weights, name, made)
    order = None
    if training:  # an empty source is refused before any work
        windows = [h.windows for h in held]  # Parquet's row groups: read a window at a time
        order = Order([len(h) for h in held], weights, params.seed, windows)
        _warn_if_over_an_epoch(sum(len(h) for h in held), params, name)
    data = concat(held, name)
    examples = None  # preprocessed examples in memory, when they fit
    if isinstance(data, ArraySource) and made.pipeline["cache"] and len(data):
        examples = data.preprocessed(preprocess, memory_limit(made.pipeline))
    _check_lengths(made.lengths, data, examples, preprocess, name, len(sources))
    packer = None
    if made.packing.active:
        lengths_of = _packable(data, examples, preprocess, made.packing, name)
        packer = packing.Packer(made.packing, lengths_of(), order, params, examples is None)
    if training:
        return _training(order, data, examples, packer, preprocess, augment, made, params, name)
    return _inference(data, examples, packer, mode, params, preprocess, made)


def _alike(held: list, sources: list) -> list:
    """Sources all in memory, or all read by index.

    Records that were held in memory are read from disk again when another's are too
    large, so that all join as one (``sources.concat``).
    """
    if not any(isinstance(h, RecordExamples) for h in held):
        return held
    return [s if isinstance(s, RecordExamples) else h for h, s in zip(held, sources, strict=True)]


def _check_lengths(shapes, data, examples, preprocess, name: str, sources: int) -> None:
    """Refuses length knobs the source cannot take, and examples no bucket holds."""
    as_batched = examples if examples is not None else data
    lengths.check(shapes, as_batched, name, sources, preprocessed=examples is not None)
    if isinstance(as_batched, RecordExamples):
        lengths.check_kept(shapes, as_batched, preprocess, name)


def _training(order, data, examples, packer, preprocess, augment, made, params, name):
    """The endless training stream of a source read by index, batched as ``made.kind`` says."""
    as_batched = examples if examples is not None else data
    example_lengths = functools.cache(lambda: lengths.example_lengths(as_batched))
    if made.lengths.group_batches:  # an order over any kind
        window = made.lengths.group_batches * params.global_batch_size
        order = lengths.Grouped(order, example_lengths(), window, name)
    reader = reader_of(data, examples, preprocess)
    stream = Training(order, reader, params, made, augment, name, example_lengths, packer)
    return STREAMS[made.kind](stream)


@dataclasses.dataclass(frozen=True)
class Training:
    """What each kind of batching makes its training stream of."""

    order: Order | lengths.Grouped  # the rows of the stream's positions
    reader: Reader  # the rows' examples, in memory or on disk
    params: InputParams
    made: batching.Batching
    augment: Augment | None
    name: str  # names the source in a refusal
    example_lengths: Callable[[], np.ndarray]  # computed once, when first asked
    packer: packing.Packer | None  # with packing.length


def _padded(stream: Training) -> tf.data.Dataset:
    """``global_batch_size`` examples a batch, each padded to the longest (or a bucket)."""
    params, made = stream.params, stream.made
    return _training_stream(
        stream.order,
        params,
        stream.reader,
        made.pipeline,
        layout=_padding(made.lengths.buckets, params.batch_size),
        augment=stream.augment,
        after=_mixed(made.mixing, params, stream.order.seed),
    )


def _packed(stream: Training) -> tf.data.Dataset:
    """Examples end to end in rows of ``packing.length`` (``datasets/packing.py``)."""
    return _training_stream(
        stream.order,
        stream.params,
        stream.reader,
        stream.made.pipeline,
        layout=stream.packer.training,
        augment=stream.augment,
    )


def _inference(data, examples, packer, mode: Mode, params: InputParams, preprocess, made):
    """An EVAL or PREDICT pass over a source read by index: each example once, in order."""
    rows = tf.data.Dataset.range(len(data))
    if params.num_input_pipelines > 1:
        rows = rows.shard(params.num_input_pipelines, params.input_pipeline_id)
    buckets = made.lengths.buckets
    if examples is not None:
        laid_out = _inference_layout(packer, mode, buckets)
        dataset = rows.batch(params.batch_size).map(lambda r: laid_out(examples.gather(r)))
    else:
        if isinstance(data, RecordExamples):
            single = data.examples(rows)
        else:
            single = rows.map(data.gather, num_parallel_calls=tf.data.AUTOTUNE)
        dataset = single.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
        if packer is None:
            dataset = _batch(dataset, params.batch_size, buckets=buckets)
        else:  # records on disk, packed as those in memory are
            laid_out = _inference_layout(packer, mode, buckets)
            dataset = dataset.ragged_batch(params.batch_size).map(lambda *batch: laid_out(batch))
    return counted(_finish(dataset, made.pipeline), int(rows.cardinality()))


def _packable(data, examples, preprocess, packs, name) -> Callable[[], np.ndarray]:
    """``lengths_of()``: the examples' lengths, once checked fit to pack.

    In memory, preprocessed; or records on disk whose lengths were kept.
    """
    if examples is None and isinstance(data, RecordExamples) and data.lengths is not None:
        spec = data.examples(tf.data.Dataset.range(1)).map(preprocess).element_spec
        return lambda: packing.check_records(packs, spec, data.lengths, name)
    return lambda: packing.check(packs, examples, name)


def _inference_layout(packer: packing.Packer | None, mode: Mode, buckets) -> Callable:
    """How an EVAL or PREDICT batch in memory is laid out: padded, or as packing says."""
    if packer is None:
        return lambda batch: padded(batch, buckets)
    return packer.prediction if mode == Mode.PREDICT else packer.evaluation


def _training_stream(
    order: Order | lengths.Grouped,
    params: InputParams,
    reader: Reader,
    knobs: dict,
    layout: Callable,
    augment: Augment | None = None,
    after: Callable | None = None,
) -> tf.data.Dataset:
    """The endless training batches of this pipeline, from ``params.start_example`` on.

    Each batch: its stream positions, their rows in the training ``order``, read at once
    (``reader.items``); then its examples, each augmented for its position, or the
    whole batch in one call (``reader.whole``); then ``layout(batch, elements)``
    (padded, packed) and ``after(features, labels, positions)`` (mixed), if given.
    """

    def read(elements):
        positions = pipeline_positions(elements, params)
        return elements, positions, reader.items(order.rows(positions))

    example_at = _example_at(reader, augment, order.seed)

    def example(element, position, item):
        return example_at(position, item), element, position

    def laid_out(batch, elements, positions):
        element = layout(batch, elements)
        return after(*element, positions) if after else element

    stream = tf.data.Dataset.range(np.iinfo(np.int64).max).batch(params.batch_size, True)
    if reader.whole is not None and augment is None:  # a whole batch in one call

        def whole(elements):
            elements, positions, items = read(elements)
            return laid_out(reader.whole(items), elements, positions)

        batches = stream.map(whole, num_parallel_calls=tf.data.AUTOTUNE)
    else:  # its examples one by one
        single = stream.map(read, num_parallel_calls=tf.data.AUTOTUNE).unbatch()
        single = single.map(example, num_parallel_calls=tf.data.AUTOTUNE)
        batch = single.batch if fixed_shapes(single.element_spec) else single.ragged_batch
        batches = batch(params.batch_size, drop_remainder=True).map(
            laid_out, num_parallel_calls=tf.data.AUTOTUNE
        )
    return positioned(_finish(batches, knobs, symbolic=True))


def _example_at(reader: Reader, augment: Augment | None, seed: int | None) -> Callable:
    """``example(position, item)``: a training example, augmented for its stream position."""

    def example(position, item):
        features, labels = reader.example(item)
        if augment is not None:
            features, labels = augment(features, labels, _stateless_seed(seed, position))
        return features, labels

    return example


def _budgeted(stream: Training) -> tf.data.Dataset:
    """As many examples a batch as fit ``lengths.token_budget`` (``datasets/token_budget.py``)."""
    params, reader, augment, shapes = (
        stream.params,
        stream.reader,
        stream.augment,
        stream.made.lengths,
    )
    budget = token_budget.Budget(
        stream.order,
        stream.example_lengths(),
        shapes.token_budget,
        shapes.buckets,
        params.global_batch_size,
        stream.name,
    )
    budget.check_replicas(replica_shares(params)[0], stream.name)
    example = _example_at(reader, augment, budget.order.seed)

    def batch_of(positions, rows):
        items = reader.items(rows)
        if reader.whole is not None and augment is None:  # a whole batch in one call
            return reader.whole(items)
        single = tf.data.Dataset.from_tensor_slices((positions, items)).map(example)
        return single.ragged_batch(budget.most).get_single_element()

    dataset = token_budget.stream(budget, params, batch_of)
    finished = _finish(dataset, stream.made.pipeline, symbolic=True)
    return sized_by(positioned(finished), budget.after)


# How each kind of batching (``batching.KINDS``) makes the training stream.
STREAMS = {"padded": _padded, "budgeted": _budgeted, "packed": _packed}


def _batch(
    dataset: tf.data.Dataset, size: int, drop_remainder: bool = False, buckets: Sequence[int] = ()
):
    """Single examples batched; those that vary in length ragged, then ``padded``."""
    if fixed_shapes(dataset.element_spec):
        return dataset.batch(size, drop_remainder=drop_remainder)
    ragged = dataset.ragged_batch(size, drop_remainder=drop_remainder)

    def padded_batch(*element):  # a tuple element comes as its parts
        element = padded(element if len(element) > 1 else element[0], buckets)
        return _sized(element, size) if drop_remainder else element

    return ragged.map(padded_batch, num_parallel_calls=tf.data.AUTOTUNE)


def _padding(buckets: Sequence[int], size: int) -> Callable:
    """``layout(batch, elements)``: its ragged parts padded (to ``buckets``), of batch ``size``."""
    return lambda batch, elements: _sized(padded(batch, buckets), size)


@tf.autograph.experimental.do_not_convert
def _sized(batch, size: int):
    """The batch with its static batch size set (padding computes it): one shape for XLA."""

    def sized(t):
        t.set_shape(tf.TensorShape([size]).concatenate(t.shape[1:]))
        return t

    return tf.nest.map_structure(sized, batch)


def _mixed(mix: mixing.Mixing, params: InputParams, seed: int | None) -> Callable | None:
    """The batches' mixing as ``mixing`` is bound, or None when it mixes nothing.

    It maps ``(features, labels, stream positions)`` to ``(features, labels)``.
    """
    mixing.check_batch(mix, params.batch_size)
    if not mix.active:
        return None
    return lambda features, labels, positions: mixing.mix(
        features, labels, positions, seed or 0, mix
    )


def batched(
    records: tf.data.Dataset | RandomAccess,
    mode: Mode,
    params: InputParams,
    parse: Callable[[tf.Tensor], tuple[dict, dict]],
    *,
    augment: Augment | None = None,
    name: str = "data",
) -> tf.data.Dataset:
    """The batched ``(features, labels)`` dataset from serialized records.

    In TRAIN a ``RandomAccess`` source is read by index, a batch of records per
    read; a ``tf.data.Dataset`` of records (in EVAL and PREDICT, always one) is read
    in sequence (in TRAIN cached and shuffled serialized). Each batch is parsed with
    one call of ``parse`` (vectorised); ``augment(features, labels, seed)`` then acts
    on whole batches in TRAIN.
    """
    made = batching.Batching(options(), mixing=mixing.options())  # no lengths, no packing
    knobs = made.pipeline
    _check_batch(params)
    training = mode == Mode.TRAIN
    if training and isinstance(records, RandomAccess):
        order = Order([len(records)], seed=params.seed)
        _warn_if_over_an_epoch(len(records), params, name)

        mixed = _mixed(made.mixing, params, order.seed)

        def augmented(features, labels, positions):  # a whole batch, seeded by its first
            if augment is not None:
                seed = _stateless_seed(order.seed, positions[0])
                features, labels = augment(features, labels, seed)
            return mixed(features, labels, positions) if mixed else (features, labels)

        return _training_stream(
            order,
            params,
            Reader(records.read, parse, whole=parse),  # parsed a batch at a time
            knobs,
            layout=_padding((), params.batch_size),
            after=augmented,
        )
    dataset = _cache(records, knobs["cache"], name)
    if training:
        _log_sequential(name, "its records are read in sequence")
        dataset = dataset.shuffle(knobs["shuffle_buffer"], seed=params.seed).repeat()
    dataset = dataset.batch(params.batch_size, drop_remainder=training)
    dataset = dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    if training and augment is not None:
        dataset = _with_seeds(dataset, params.seed).map(
            lambda element, seed: augment(*element, seed), num_parallel_calls=tf.data.AUTOTUNE
        )
    if training:
        dataset = _mixed_in_sequence(dataset, made.mixing, params)
    return _finish(dataset, knobs)


@tf.autograph.experimental.do_not_convert
def unit_range(image: tf.Tensor) -> tf.Tensor:
    """uint8 pixels (of one image or a batch) as float32 in [0, 1]."""
    return tf.cast(image, tf.float32) / 255.0


@tf.autograph.experimental.do_not_convert
def image_features(stored: dict) -> dict:
    """The model's features of a stored image example (or batch): pixels in [0, 1].

    What training maps over the records and what an export's serving signature
    applies to the images a client sends (``trainer.serves``): one function.
    """
    return {"image": unit_range(stored["image"])}


@tf.autograph.experimental.do_not_convert
def _stateless_seed(seed: int, position: tf.Tensor) -> tf.Tensor:
    """A shape-[2] seed for stateless random ops, unique to (run seed, stream position)."""
    return tf.stack([tf.constant(seed, tf.int64), tf.cast(position, tf.int64)])


def _log_sequential(name: str, reason: str, fix: str | None = None) -> None:
    logging.warning(
        "Training reads %s in sequence with a shuffle buffer (%s): each checkpoint then "
        "saves the buffer, and resuming under a tf.distribute strategy replays the input. "
        "Read it by index: %s",
        name,
        reason,
        fix or "an ArraySource, pipeline.memory_limit_mb, or TFRecord shards",
    )


def _sequential(sources, mode, params, preprocess, augment, weights, name, made):
    """The pre-index pipeline: map, cache, shuffle buffer, repeat; for sources read in order."""
    training, knobs = mode == Mode.TRAIN, made.pipeline

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
    if training:
        dataset = _mixed_in_sequence(dataset, made.mixing, params)
    return _finish(dataset, knobs)


def _mixed_in_sequence(dataset: tf.data.Dataset, mix, params: InputParams) -> tf.data.Dataset:
    """Training batches read in sequence, mixed: their positions counted from this read."""
    mixed, size = _mixed(mix, params, params.seed), params.batch_size
    if not mixed:
        return dataset
    return dataset.enumerate().map(
        lambda k, element: mixed(*element, k * size + tf.range(size, dtype=tf.int64)),
        num_parallel_calls=tf.data.AUTOTUNE,
    )


_WARNED: set[str] = set()  # sources warned of, once a process


def _warn_if_over_an_epoch(examples: int, params: InputParams, name: str) -> None:
    """Warns once when one training batch holds more examples than the data has."""
    if params.global_batch_size <= examples or name in _WARNED:
        return
    _WARNED.add(name)
    logging.warning(
        "a batch of %s examples is larger than the training data (%s examples in %r): each "
        "step repeats examples, and an epoch is less than a step; lower "
        "Estimator.global_batch_size",
        f"{params.global_batch_size:,}",
        f"{examples:,}",
        name,
    )


def _check_batch(params: InputParams) -> None:
    if params.batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {params.batch_size}")


def _cache(dataset: tf.data.Dataset, cache: bool | str, name: str) -> tf.data.Dataset:
    if cache is True:
        return dataset.cache()
    if isinstance(cache, str) and cache and cache != "auto":
        tf.io.gfile.makedirs(cache)
        return dataset.cache(f"{cache.rstrip('/')}/{name.replace('/', '_')}")
    return dataset


def _with_seeds(dataset: tf.data.Dataset, seed: int | None) -> tf.data.Dataset:
    """Pairs each element with a fresh shape-[2] seed for stateless random ops."""
    return tf.data.Dataset.zip((dataset, tf.data.Dataset.random(seed=seed).batch(2)))


def _finish(dataset: tf.data.Dataset, knobs: dict, symbolic: bool = False) -> tf.data.Dataset:
    dataset_options = tf.data.Options()
    dataset_options.deterministic = knobs["deterministic"]
    # An index-based pipeline's iterator, if anyone saves it (the Estimator needs not),
    # is a few positions, not the prefetched batches.
    dataset_options.experimental_symbolic_checkpoint = symbolic
    return dataset.with_options(dataset_options).prefetch(tf.data.AUTOTUNE)
