"""Sharded TFRecord files of tf.train.Example: writing, checking and fast reading.

Layout of a prepared directory::

    DIR/dataset.json                     shapes, format, classes, per-shard counts/bytes
    DIR/train-00000-of-00004.tfrecord    (".tfrecord.gz" with GZIP)
    DIR/test-00000-of-00001.tfrecord

    DIR/train-00000-of-00004.tfrecord.index   each record's byte offset (int64 .npy)

Each record holds ``image`` (PNG-encoded, or raw uint8 bytes) and ``label`` (int64).
Records of encoded images of varying sizes (``prepare --images``, ``--tfrecords``;
``image_format`` 'encoded') are read by ``datasets/images.py``; ``datasets/records/shards.py``
writes the fixed-size ones.
Examples keep their order: shard k holds the k-th contiguous block. Reading checks
every shard against ``dataset.json`` first (a missing or truncated file is named at
once), reads a batch of serialized records at a time and parses it with one
vectorised ``tf.io.parse_example``.

Training reads records **by index** (``indexed.RecordSource``): the record offsets
of each shard let one ``pread`` fetch any record, and its CRC is checked, so the
training order is a global permutation per epoch and a checkpoint holds no input
state (see ``datasets/order.py``). ``write`` saves the offsets beside each shard,
checksummed; a directory prepared without them (or by other tools), or with a
damaged index, is indexed once, by one checked pass over its records. GZIP shards
cannot be read by offset: they are read in sequence with a shuffle buffer.
Evaluation reads every record once, in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import gin
import numpy as np
import tensorflow as tf
from absl import logging

from datasets import images, pipeline
from datasets.records import indexed, shards
from datasets.records.shards import METADATA, check_shards, count_readable, read_metadata
from trainer import InputParams, Mode, UserError
from trainer.model_fn import check_class_ids
from trainer.serving import serves

_FEATURES = {  # of each record: PNG or raw uint8 bytes, and the class id
    "image": tf.io.FixedLenFeature([], tf.string),
    "label": tf.io.FixedLenFeature([], tf.int64),
}


def check_shape(path: str, metadata: dict) -> None:
    """Refuses records whose images are not of ``dataset.json``'s shape (reads one).

    A corrupt or unparsable first record is left for the reading to report.
    """
    shape, image_format = metadata["image_shape"], metadata["image_format"]
    first = tf.data.TFRecordDataset(path, compression_type=metadata["compression"] or "")
    try:
        for record in first.take(1):
            feature = {"image": tf.io.FixedLenFeature([], tf.string)}
            image = tf.io.parse_single_example(record, feature)["image"]
            if image_format == "raw":
                found, expected = f"{len(image.numpy())} bytes", f"{int(np.prod(shape))} bytes"
            else:
                found, expected = str(tf.io.decode_png(image).shape.as_list()), str(shape)
    except tf.errors.OpError:
        return
    if found != expected:
        raise UserError(
            f"the records of {path} hold images of {found}, where {METADATA} says {shape}"
            f"{f' ({expected})' if image_format == 'raw' else ''}: {METADATA} does not "
            "describe these files; prepare the data again, or re-copy the whole directory"
        )


@tf.autograph.experimental.do_not_convert
def parse_batch(records: tf.Tensor, metadata: dict) -> tuple[dict, dict]:
    """Parses a batch of serialized examples into ``({'image': uint8}, {'label'})``."""
    parsed = tf.io.parse_example(records, _FEATURES)
    shape = metadata["image_shape"]
    if metadata["image_format"] == "raw":
        images = tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), [-1, *shape])
    else:
        images = tf.map_fn(
            lambda png: tf.io.decode_png(png, channels=shape[-1]),
            parsed["image"],
            fn_output_signature=tf.TensorSpec(shape, tf.uint8),
        )
    label = parsed["label"]
    if metadata.get("num_classes"):
        label = check_class_ids(label, metadata["num_classes"], "a label in the data")
    return {"image": images}, {"label": label}


@tf.autograph.experimental.do_not_convert
def _parsed(batch: tf.Tensor, metadata: dict, features_of) -> tuple[dict, dict]:
    """A batch of records -> the model's features (``features_of``) and labels."""
    features, labels = parse_batch(batch, metadata)
    return features_of(features), labels


def served_as_stored(
    dataset: tf.data.Dataset, shape, features_of=pipeline.image_features
) -> tf.data.Dataset:
    """``dataset``, marked with how an export serves it (``trainer.serves``).

    The export takes uint8 images of ``shape`` as stored, or records as ``write``
    makes them, and makes the model's features of them with ``features_of``, the
    function training uses.
    """
    stored = {"image": tf.TensorSpec(shape, tf.uint8)}
    return serves(dataset, features_of, stored, example_parser(shape))


def example_parser(shape) -> Callable[[tf.Tensor], dict]:
    """Serialized records ``[batch]`` -> ``{'image': uint8 [batch, *shape]}``, for serving.

    Reads the records ``write`` makes, in either format, and a client's JPEG: an
    encoded image is told from raw bytes by its signature, so a client may send any.
    Raw bytes of another count, or an image of another size, are said in one line.
    Labels are not needed.
    """
    shape = list(shape)
    pixels = int(np.prod(shape))

    @tf.autograph.experimental.do_not_convert
    def raw(data: tf.Tensor) -> tf.Tensor:
        check = tf.debugging.assert_equal(
            tf.strings.length(data),
            pixels,
            message=f"the image of an Example is neither PNG nor JPEG, nor {pixels} bytes of "
            f"uint8 pixels {shape}; its byte count",
        )
        with tf.control_dependencies([check]):
            return tf.reshape(tf.io.decode_raw(data, tf.uint8), shape)

    @tf.autograph.experimental.do_not_convert
    def encoded(data: tf.Tensor) -> tf.Tensor:
        image = tf.io.decode_image(data, channels=shape[-1], expand_animations=False)
        check = tf.debugging.assert_equal(
            tf.shape(image),
            shape,
            message=f"the image of an Example is a PNG or JPEG of another size than {shape}: "
            "resize it before sending; its shape",
        )
        with tf.control_dependencies([check]):
            return tf.ensure_shape(tf.identity(image), shape)

    @tf.autograph.experimental.do_not_convert
    def decode(data: tf.Tensor) -> tf.Tensor:
        png = tf.equal(tf.strings.substr(data, 0, 4), b"\x89PNG")
        png_or_jpeg = tf.logical_or(png, images.is_jpeg(data))
        return tf.cond(png_or_jpeg, lambda: encoded(data), lambda: raw(data))

    @tf.autograph.experimental.do_not_convert
    def parse(records: tf.Tensor) -> dict:
        image = tf.io.parse_example(records, {"image": _FEATURES["image"]})["image"]
        spec = tf.TensorSpec(shape, tf.uint8)
        return {"image": tf.map_fn(decode, image, fn_output_signature=spec)}

    return parse


@tf.autograph.experimental.do_not_convert
def crop_flip_batch(features: dict, labels: dict, seed: tf.Tensor, pad: int = 4):
    """Per image: pad by ``pad``, crop a random window of the original size, maybe flip.

    Vectorised over the batch (``crop_and_resize`` with one box per image, at scale 1),
    with stateless randomness from ``seed``.
    """
    images = features["image"]
    height, width = images.shape[1], images.shape[2]
    batch = tf.shape(images)[0]
    padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]], mode="REFLECT")
    offsets = tf.random.stateless_uniform([batch, 2], seed, 0, 2 * pad + 1, dtype=tf.int32)
    top = tf.cast(offsets[:, 0], tf.float32)
    left = tf.cast(offsets[:, 1], tf.float32)
    full_h, full_w = float(height + 2 * pad - 1), float(width + 2 * pad - 1)
    boxes = tf.stack(
        [top / full_h, left / full_w, (top + height - 1) / full_h, (left + width - 1) / full_w],
        axis=1,
    )
    cropped = tf.image.crop_and_resize(padded, boxes, tf.range(batch), [height, width])
    flip = tf.random.stateless_uniform([batch], seed + 1) < 0.5
    flipped = tf.where(flip[:, None, None, None], tf.reverse(cropped, axis=[2]), cropped)
    return {**features, "image": flipped}, labels


def read(
    data_dir: str,
    split: str | None,
    mode: Mode,
    params: InputParams,
    *,
    augment: bool | str = False,
    skip_corrupt: bool = False,
    by_index: bool = True,
    image_size: int | None = None,
) -> tf.data.Dataset:
    """Batches of ``({'image': float32 [b, h, w, c] in [0, 1]}, {'label': [b]})`` from shards.

    Marked with how an export serves them (``trainer.serves``): uint8 images as the
    records hold them, or the serialized records themselves.

    Args:
      data_dir: a directory written by ``write`` (``python -m datasets.prepare``).
      split: which split's shards to read; None: the evaluation split ``dataset.json``
        names.
      mode: TRAIN shuffles shards and records, repeats and drops the last partial
        batch; EVAL and PREDICT read every record once, in order.
      params: batch size, seed, and this pipeline's share of the shards.
      augment: in TRAIN, True pads, crops back and flips each image; 'inception' is
        the random-resized crop of ImageNet training (encoded images only).
      skip_corrupt: skip unreadable records instead of failing; how many are skipped
        in which file is counted once up front and logged.
      by_index: in TRAIN, read records by offset in a global order (uncompressed
        shards); False reads the shards in sequence with a shuffle buffer, for storage
        where random reads are slow (its buffer is then saved in each checkpoint).
      image_size: give every image this square size. Encoded images of varying sizes
        are centre-cropped as ImageNet's are (``datasets/images.py``); fixed-size ones
        are resized so that their shorter side fits, then centre-cropped.
    """
    metadata, paths = check_shards(data_dir, split)
    split = split or shards.eval_split(metadata)
    if metadata["image_format"] == images.ENCODED:
        return images.read(
            data_dir,
            metadata,
            paths,
            split,
            mode,
            params,
            image_size=image_size,
            augment=augment,
            skip_corrupt=skip_corrupt,
        )
    if augment not in (False, True):
        raise UserError(
            f"tfrecord.input_fn.augment = {augment!r} needs encoded images (prepared with "
            f"--images or --tfrecords); {data_dir} holds {metadata['image_format']} images: "
            "use augment = True"
        )
    compression = metadata["compression"] or ""
    training = mode == Mode.TRAIN
    shape = metadata["image_shape"]
    features_of = pipeline.image_features
    if image_size is not None:
        features_of = functools.partial(images.square_features, size=image_size)
    parse = functools.partial(_parsed, metadata=metadata, features_of=features_of)
    augment_fn = crop_flip_batch if augment and training else None
    counts = [shard["count"] for shard in metadata["splits"][split]["shards"]]
    check_shape(paths[0], metadata)

    def batched(examples) -> tf.data.Dataset:  # marked with how an export serves them
        dataset = pipeline.batched(
            examples, mode, params, parse=parse, augment=augment_fn, name=f"tfrecord-{split}"
        )
        return served_as_stored(dataset, shape, features_of)

    if (by_index or not training) and not compression:
        offsets = [
            indexed.record_offsets(p, n, skip_corrupt) for p, n in zip(paths, counts, strict=True)
        ]
        source = indexed.RecordSource(paths, offsets)
        if not training:  # in order, by offset: a corrupt record is named with its shard
            source = indexed.in_order(source, params.num_input_pipelines, params.input_pipeline_id)
        return batched(source)
    shard_list = metadata["splits"][split]["shards"]
    return batched(_in_sequence(paths, shard_list, compression, params, training, skip_corrupt))


def _in_sequence(paths, shard_list, compression, params, training, skip_corrupt) -> tf.data.Dataset:
    """The shards' records read in sequence (compressed, or ``by_index=False``)."""
    if skip_corrupt:
        for path, shard in zip(paths, shard_list, strict=True):
            count, clean = count_readable(path, compression)
            if count != shard["count"] or not clean:
                logging.warning(
                    "Skipping %d unreadable records of %d in %s",
                    shard["count"] - count,
                    shard["count"],
                    path,
                )
    files = tf.data.Dataset.from_tensor_slices(paths)
    if params.num_input_pipelines > 1:
        files = files.shard(params.num_input_pipelines, params.input_pipeline_id)
    if training:
        files = files.shuffle(len(paths), seed=params.seed)

    def shard_records(path):
        dataset = tf.data.TFRecordDataset(path, compression_type=compression)
        return dataset.ignore_errors() if skip_corrupt else dataset

    # Training reads up to 8 shards at once; eval and predict read them in order, so
    # that results line up with the data.
    dataset = files.interleave(
        shard_records,
        cycle_length=min(len(paths), 8) if training else 1,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return dataset


@gin.configurable
def input_fn(
    mode: Mode,
    params: InputParams,
    data_dir: str = gin.REQUIRED,
    train_split: str = "train",
    eval_split: str | None = None,
    augment: bool | str = False,
    skip_corrupt: bool = False,
    by_index: bool = True,
    image_size: int | None = None,
) -> tf.data.Dataset:
    """An input_fn over a prepared TFRecord directory (see ``read``).

    Yields ``({'image': float32 [batch, h, w, c] in [0, 1]}, {'label': int64 [batch]})``,
    with ``h, w, c`` and the number of classes from the directory's ``dataset.json``
    (digits: ``[batch, 8, 8, 1]``, labels 0..9): the same keys, types and ranges as
    ``digits.input_fn`` and ``tfds_images.input_fn``, so one model reads all three.
    TRAIN reads ``train_split`` forever, EVAL and PREDICT ``eval_split`` once.
    """
    split = train_split if mode == Mode.TRAIN else eval_split  # None: as dataset.json says
    return read(
        data_dir,
        split,
        mode,
        params,
        augment=augment,
        skip_corrupt=skip_corrupt,
        by_index=by_index,
        image_size=image_size,
    )


@gin.configurable
def num_classes(data_dir: str | None = None) -> int:
    """The number of classes ``dataset.json`` records, for a model's output layer.

    ``MLP.num_classes = @tfrecord.num_classes()`` in gin; ``data_dir`` defaults to
    ``tfrecord.input_fn.data_dir``'s binding.
    """
    data_dir = data_dir or gin.query_parameter("tfrecord.input_fn.data_dir")
    classes = read_metadata(data_dir).get("num_classes")
    if not classes:
        raise UserError(
            f"{data_dir}/{METADATA} records no number of classes: set the model's num_classes"
        )
    return int(classes)
