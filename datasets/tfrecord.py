"""Sharded TFRecord files of tf.train.Example: writing, checking and fast reading.

Layout of a prepared directory::

    DIR/dataset.json                     shapes, format, classes, per-shard counts/bytes
    DIR/train-00000-of-00004.tfrecord    (".tfrecord.gz" with GZIP)
    DIR/test-00000-of-00001.tfrecord

    DIR/train-00000-of-00004.tfrecord.index   each record's byte offset (int64 .npy)

Each record holds ``image`` (PNG-encoded, or raw uint8 bytes) and ``label`` (int64).
Examples keep their order: shard k holds the k-th contiguous block. Reading checks
every shard against ``dataset.json`` first (a missing or truncated file is named at
once), reads a batch of serialized records at a time and parses it with one
vectorised ``tf.io.parse_example``.

Training reads records **by index** (``records.RecordSource``): the record offsets
of each shard let one ``pread`` fetch any record, and its CRC is checked, so the
training order is a global permutation per epoch and a checkpoint holds no input
state (see ``datasets/order.py``). ``write`` saves the offsets beside each shard,
checksummed; a directory prepared without them (or by other tools), or with a
damaged index, is indexed once, by one checked pass over its records. GZIP shards
cannot be read by offset: they are read in sequence with a shuffle buffer.
Evaluation reads every record once, in order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import gin
import numpy as np
import tensorflow as tf
from absl import logging

from datasets import pipeline, records
from trainer import InputParams, Mode, UserError, files
from trainer.model_fn import check_class_ids
from trainer.serving import serves

METADATA = "dataset.json"
FORMATS = ("png", "raw")
_FEATURES = {  # of each record: PNG or raw uint8 bytes, and the class id
    "image": tf.io.FixedLenFeature([], tf.string),
    "label": tf.io.FixedLenFeature([], tf.int64),
}


def shard_name(split: str, index: int, count: int, compression: str | None) -> str:
    """``train-00003-of-00007.tfrecord`` (``.gz`` appended for GZIP)."""
    suffix = ".tfrecord.gz" if compression == "GZIP" else ".tfrecord"
    return f"{split}-{index:05d}-of-{count:05d}{suffix}"


def _example(image: np.ndarray, label: int, image_format: str) -> bytes:
    if image_format == "png":
        data = tf.io.encode_png(image).numpy()
    else:
        data = np.ascontiguousarray(image, dtype=np.uint8).tobytes()
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write(
    examples: Iterable[dict],
    out_dir: str,
    split: str,
    num_shards: int,
    image_format: str = "png",
    compression: str | None = None,
    num_classes: int | None = None,
) -> dict:
    """Writes ``{'image': uint8 [h, w, c], 'label': int}`` examples as ``num_shards`` files.

    Files are written under temporary names and renamed when complete; ``dataset.json``
    is updated last. Returns this split's metadata.
    """
    if image_format not in FORMATS:
        raise UserError(f"image format must be one of {FORMATS}, got {image_format!r}")
    examples = [(np.asarray(e["image"], np.uint8), int(e["label"])) for e in examples]
    if not examples:
        raise UserError(f"split {split!r} has no examples to write")
    shape = examples[0][0].shape
    tf.io.gfile.makedirs(out_dir)
    options = tf.io.TFRecordOptions(compression_type=compression or "")
    blocks = np.array_split(np.arange(len(examples)), num_shards)
    shards = []
    for index, block in enumerate(blocks):
        name = shard_name(split, index, num_shards, compression)
        path = os.path.join(out_dir, name)
        offsets, offset = [], 0
        with tf.io.TFRecordWriter(path + ".tmp", options) as writer:
            for i in block:
                image, label = examples[i]
                if image.shape != shape:
                    raise UserError(
                        f"example {i} of {split!r} has shape {image.shape}, "
                        f"the first had {shape}: images must share one shape"
                    )
                record = _example(image, label, image_format)
                writer.write(record)
                offsets.append(offset)
                offset += records.HEADER + len(record) + 4
        tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
        if not compression:
            records.write_index(path, np.asarray(offsets, np.int64))
        shards.append({"file": name, "count": len(block), "bytes": tf.io.gfile.stat(path).length})
    entry = {"shards": shards, "count": len(examples)}
    metadata = _read_metadata(out_dir, missing_ok=True) or {}
    metadata.update(
        image_shape=list(shape),
        image_format=image_format,
        compression=compression,
        num_classes=num_classes,
    )
    metadata.setdefault("splits", {})[split] = entry
    files.write_json(os.path.join(out_dir, METADATA), metadata)
    return entry


def _read_metadata(data_dir: str, missing_ok: bool = False) -> dict | None:
    path = os.path.join(data_dir, METADATA)
    try:
        metadata = files.read_json(path)
    except files.Unreadable as error:
        raise UserError(
            f"{error}: it describes the prepared data in {data_dir}; re-copy it, or prepare "
            f"the data again with `python3 -m datasets.prepare --out {data_dir} ...`"
        ) from None
    if metadata is None and not missing_ok:
        raise UserError(
            f"{path} not found: prepare the data with "
            f"`python3 -m datasets.prepare --out {data_dir} ...`"
        )
    return metadata


def check_shards(data_dir: str, split: str) -> tuple[dict, list[str]]:
    """The metadata and shard paths of ``split``, after checking each file exists at full size."""
    metadata = _read_metadata(data_dir)
    splits = metadata.get("splits", {})
    if split not in splits:
        raise UserError(f"{data_dir} has no split {split!r}; it has {', '.join(sorted(splits))}")
    if splits[split]["count"] == 0:
        raise UserError(f"split {split!r} in {data_dir} is empty")
    paths = []
    for shard in splits[split]["shards"]:
        path = os.path.join(data_dir, shard["file"])
        if not tf.io.gfile.exists(path):
            raise UserError(f"shard {path} is missing: re-copy it or prepare the data again")
        size = tf.io.gfile.stat(path).length
        if size != shard["bytes"]:
            raise UserError(
                f"shard {path} is {size} bytes, {shard['bytes']} were written "
                "(truncated or overwritten?): re-copy it or prepare the data again"
            )
        paths.append(path)
    return metadata, paths


def count_readable(path: str, compression: str | None) -> tuple[int, bool]:
    """(records read before the first error, whether the file read to its end cleanly)."""
    count = 0
    try:
        for _ in tf.data.TFRecordDataset(path, compression_type=compression or ""):
            count += 1
    except tf.errors.DataLossError:
        return count, False
    return count, True


def verify(data_dir: str, split: str) -> list[str]:
    """Reads every record of ``split``; returns one line per damaged shard (none: all good)."""
    metadata, paths = check_shards(data_dir, split)
    problems = []
    for path, shard in zip(paths, metadata["splits"][split]["shards"], strict=True):
        count, clean = count_readable(path, metadata["compression"])
        if not clean or count != shard["count"]:
            problems.append(f"{path}: {count} of {shard['count']} records readable")
    return problems


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
def scale_batch(features: dict, labels: dict) -> tuple[dict, dict]:
    """uint8 images to float32 in [0, 1]."""
    return pipeline.image_features(features), labels


def served_as_stored(dataset: tf.data.Dataset, shape) -> tf.data.Dataset:
    """``dataset``, marked with how an export serves it (``trainer.serves``).

    The export takes uint8 images of ``shape`` as stored, or records as ``write``
    makes them, and scales them with the function training uses.
    """
    stored = {"image": tf.TensorSpec(shape, tf.uint8)}
    return serves(dataset, pipeline.image_features, stored, example_parser(shape))


def example_parser(shape) -> Callable[[tf.Tensor], dict]:
    """Serialized records ``[batch]`` -> ``{'image': uint8 [batch, *shape]}``, for serving.

    Reads the records ``write`` makes, in either format: PNG is told from raw bytes
    by its signature, so a client may send either. Labels are not needed.
    """
    shape = list(shape)

    @tf.autograph.experimental.do_not_convert
    def decode(data: tf.Tensor) -> tf.Tensor:
        return tf.cond(
            tf.equal(tf.strings.substr(data, 0, 4), b"\x89PNG"),
            lambda: tf.ensure_shape(tf.io.decode_png(data, channels=shape[-1]), shape),
            lambda: tf.reshape(tf.io.decode_raw(data, tf.uint8), shape),
        )

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
    split: str,
    mode: Mode,
    params: InputParams,
    *,
    augment: bool = False,
    skip_corrupt: bool = False,
    by_index: bool = True,
) -> tf.data.Dataset:
    """Batches of ``({'image': float32 [b, h, w, c] in [0, 1]}, {'label': [b]})`` from shards.

    Marked with how an export serves them (``trainer.serves``): uint8 images as the
    records hold them, or the serialized records themselves.

    Args:
      data_dir: a directory written by ``write`` (``python -m datasets.prepare``).
      split: which split's shards to read.
      mode: TRAIN shuffles shards and records, repeats and drops the last partial
        batch; EVAL and PREDICT read every record once, in order.
      params: batch size, seed, and this pipeline's share of the shards.
      augment: random crop and flip per image in TRAIN.
      skip_corrupt: skip unreadable records instead of failing; how many are skipped
        in which file is counted once up front and logged.
      by_index: in TRAIN, read records by offset in a global order (uncompressed
        shards); False reads the shards in sequence with a shuffle buffer, for storage
        where random reads are slow (its buffer is then saved in each checkpoint).
    """
    metadata, paths = check_shards(data_dir, split)
    compression = metadata["compression"] or ""
    training = mode == Mode.TRAIN
    parse = lambda batch: scale_batch(*parse_batch(batch, metadata))  # noqa: E731
    augment_fn = crop_flip_batch if augment and training else None
    counts = [shard["count"] for shard in metadata["splits"][split]["shards"]]
    check_shape(paths[0], metadata)
    shape = metadata["image_shape"]

    def batched(examples) -> tf.data.Dataset:  # marked with how an export serves them
        dataset = pipeline.batched(
            examples, mode, params, parse=parse, augment=augment_fn, name=f"tfrecord-{split}"
        )
        return served_as_stored(dataset, shape)

    if (by_index or not training) and not compression:
        offsets = [
            records.record_offsets(p, n, skip_corrupt) for p, n in zip(paths, counts, strict=True)
        ]
        source = records.RecordSource(paths, offsets)
        if not training:  # in order, by offset: a corrupt record is named with its shard
            source = records.in_order(source, params.num_input_pipelines, params.input_pipeline_id)
        return batched(source)
    if skip_corrupt:
        for path, shard in zip(paths, metadata["splits"][split]["shards"], strict=True):
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
    return batched(dataset)


@gin.configurable
def input_fn(
    mode: Mode,
    params: InputParams,
    data_dir: str = gin.REQUIRED,
    train_split: str = "train",
    eval_split: str = "test",
    augment: bool = False,
    skip_corrupt: bool = False,
    by_index: bool = True,
) -> tf.data.Dataset:
    """An input_fn over a prepared TFRecord directory (see ``read``).

    Yields ``({'image': float32 [batch, h, w, c] in [0, 1]}, {'label': int64 [batch]})``,
    with ``h, w, c`` and the number of classes from the directory's ``dataset.json``
    (digits: ``[batch, 8, 8, 1]``, labels 0..9): the same keys, types and ranges as
    ``digits.input_fn`` and ``tfds_images.input_fn``, so one model reads all three.
    TRAIN reads ``train_split`` forever, EVAL and PREDICT ``eval_split`` once.
    """
    split = train_split if mode == Mode.TRAIN else eval_split
    return read(
        data_dir,
        split,
        mode,
        params,
        augment=augment,
        skip_corrupt=skip_corrupt,
        by_index=by_index,
    )
