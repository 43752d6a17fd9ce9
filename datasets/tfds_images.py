"""Image classification datasets from TFDS: mnist, fashion_mnist, cifar10, cifar100.

``input_fn`` reads a prepared copy from ``data_dir`` (TFDS's default when None) and
downloads it when it is missing and the network is there. When it is missing and
cannot be downloaded, it says so in one line and how to get it, instead of the
downloader retrying for minutes. Splits take TFDS slicing, e.g. 'train[:90%]'.

A dataset prepared as ArrayRecord (``tfds build NAME --file_format=array_record``)
is read by index from its files when it does not fit in memory, so training on
data of any size keeps exact, constant-time resume; one prepared as TFRecord (TFDS's
default) is held in memory when it fits and read in sequence otherwise.

Preprocessing: pixels scaled to [0, 1]; optionally per-image standardisation;
optionally resized and centre-cropped to one square size; in training, optionally
the CIFAR augmentation (pad by 4 to 40x40 for 32x32 images, random crop back,
random horizontal flip).
"""

from __future__ import annotations

import functools
import socket

import gin
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from datasets import pipeline
from datasets.images import central_square, pad_crop_flip
from datasets.records import tfrecord
from trainer import InputParams, Mode, UserError, console, errors
from trainer.serving import serves

DOWNLOAD_HOST = "storage.googleapis.com"  # where TFDS keeps its prepared datasets


@tf.autograph.experimental.do_not_convert
def preprocess(
    example: dict, standardize: bool = False, image_size: int | None = None
) -> tuple[dict, dict]:
    """Scales ``image`` to [0, 1] (or standardises it); returns ``({'image'}, {'label'})``.

    With ``image_size``, the image is first resized so that its shorter side is
    ``image_size``, then cropped to the central ``image_size`` square: images of
    varying sizes (ImageNet) come out of one shape.
    """
    return features_of(example, standardize, image_size), {"label": example["label"]}


@tf.autograph.experimental.do_not_convert
def features_of(example: dict, standardize: bool = False, image_size: int | None = None):
    """The model's features of one stored example; see ``preprocess``.

    Training maps it over the records; an export applies it to the images a client
    sends (``trainer.serves``).
    """
    image = pipeline.unit_range(example["image"])
    if image_size is not None:
        image = central_square(image, image_size)
    if standardize:
        image = tf.image.per_image_standardization(image)
    return {"image": image}


def load(
    name: str, split: str, data_dir: str | None = None, download: bool = True
) -> tf.data.Dataset | pipeline.RecordExamples:
    """The examples of ``split`` of TFDS dataset ``name``; downloads only when it can.

    A dataset prepared as ArrayRecord is read by index (``pipeline.RecordExamples``),
    one prepared as TFRecord (TFDS's default) as a ``tf.data.Dataset``.
    """
    records = array_records(name, split, data_dir)  # also refuses an unknown name
    if records is not None:
        return records
    try:
        with console.hushed():
            return tfds.load(
                name, split=split, data_dir=data_dir, download=False, shuffle_files=False
            )
    except (AssertionError, FileNotFoundError):
        pass
    where = data_dir or "TFDS's default data_dir (~/tensorflow_datasets)"
    how = (
        f"prepare it where there is internet with `tfds build {name} --data_dir DIR`, "
        "copy DIR here and set tfds_images.input_fn.data_dir = 'DIR'"
    )
    if not download:
        raise UserError(f"dataset {name!r} is not in {where} and download is off: {how}") from None
    if not _online():
        raise UserError(
            f"dataset {name!r} is not in {where} and cannot be downloaded "
            f"(no network: {DOWNLOAD_HOST} does not resolve): {how}"
        ) from None
    try:
        return tfds.load(name, split=split, data_dir=data_dir, download=True, shuffle_files=False)
    except Exception as error:  # the downloader's many failure types
        raise UserError(
            f"downloading dataset {name!r} failed ({errors.first_line(error)}): {how}"
        ) from None


class ArrayRecords(pipeline.RandomAccess):
    """The serialized examples of a TFDS split prepared as ArrayRecord, read by index."""

    def __init__(self, source, where: str):
        self.source, self.where = source, where

    def __len__(self) -> int:
        return len(self.source)

    def _read(self, rows: np.ndarray) -> tuple[np.ndarray, str]:
        # One by one: array_record's batched read (__getitems__) starts a thread pool
        # per call, and starting threads from tf.data's own threads (this runs in a
        # py_function) once hung a whole test process in CPython's thread start.
        try:
            records = [self.source[int(row)] for row in rows]
        except Exception as error:  # the reader's errors carry the file and chunk
            return np.full(len(rows), b"", object), f"{errors.first_line(error)}, {self.where}"
        return np.asarray(records, object), ""


def array_records(name: str, split: str, data_dir: str | None) -> pipeline.RecordExamples | None:
    """The examples of ``split``, read by index, if it is prepared as ArrayRecord here."""
    try:
        with console.hushed():
            builder = tfds.builder(name, data_dir=data_dir)
            prepared = builder.is_prepared()
    except tfds.core.registered.DatasetNotFoundError:
        raise UserError(f"TFDS has no dataset named {name!r}: see `tfds.list_builders()`") from None
    if not prepared:
        return None
    if tfds.core.FileFormat.ARRAY_RECORD not in builder.info.available_file_formats():
        return None
    source = builder.as_data_source(
        split,
        deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES,
        file_format=tfds.core.FileFormat.ARRAY_RECORD,
    )
    features = builder.info.features

    def parse(record: tf.Tensor) -> dict:
        example = features.deserialize_example(record)
        return {"image": example["image"], "label": example["label"]}

    where = f"in {name} {split} at {builder.data_dir}"
    return pipeline.RecordExamples(ArrayRecords(source, where), parse, f"{name} {split}")


def _online(timeout: float = 3.0) -> bool:
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)
    try:
        socket.getaddrinfo(DOWNLOAD_HOST, 443)
        return True
    except OSError:
        return False
    finally:
        socket.setdefaulttimeout(previous)


@gin.configurable
def input_fn(
    mode: Mode,
    params: InputParams,
    name: str = gin.REQUIRED,
    train_split: str = "train",
    eval_split: str = "test",
    data_dir: str | None = None,
    download: bool = True,
    augment: bool = False,
    standardize: bool = False,
    image_size: int | None = None,
) -> tf.data.Dataset:
    """Batches of ``({'image': [b, h, w, c] in [0, 1]}, {'label': [b]})``.

    ``features['image']``: float32, the dataset's own ``h, w, c`` (mnist and
    fashion_mnist 28x28x1, cifar10 and cifar100 32x32x3; ``image_size`` squares them),
    scaled to [0, 1], or mean 0 and deviation 1 with ``standardize``.
    ``labels['label']``: int64 ``[b]``, the class id, 0..num_classes-1.

    Args:
      mode: TRAIN reads ``train_split``; EVAL and PREDICT read ``eval_split``.
      params: batch size and seed, from the framework.
      name: the TFDS name: 'mnist', 'fashion_mnist', 'cifar10', 'cifar100', ...
      train_split: the training split, with TFDS slicing ('train[:90%]').
      eval_split: the evaluation split ('test', or 'train[90%:]' for validation).
      data_dir: where prepared TFDS datasets live.
      download: allow downloading a missing dataset.
      augment: pad-crop-flip in training (for CIFAR-like natural images).
      standardize: per-image standardisation instead of plain [0, 1] scaling.
      image_size: resize and centre-crop every image to this square size (for
        datasets whose images vary in size, like imagenet2012).

    Shuffle buffer, caching and determinism are ``pipeline.*`` bindings.
    """
    split = train_split if mode == Mode.TRAIN else eval_split
    source = load(name, split, data_dir, download)
    dataset = pipeline.build(
        source,
        mode,
        params,
        functools.partial(preprocess, standardize=standardize, image_size=image_size),
        augment=pad_crop_flip if augment else None,
        name=f"{name}-{split}",
        by_index_fix=f"prepare it as ArrayRecord: `tfds build {name} --file_format=array_record`",
    )
    with console.hushed():
        image = tfds.builder(name, data_dir=data_dir).info.features["image"]
    stored = {"image": tf.TensorSpec(image.shape, tf.uint8)}
    # Records of this dataset that datasets.prepare writes: images of one size only.
    parse = tfrecord.example_parser(image.shape) if None not in image.shape else None
    features = functools.partial(features_of, standardize=standardize, image_size=image_size)
    return serves(dataset, features, stored, parse)


def varies_in_size(name: str, data_dir: str | None) -> bool:
    """Whether the images of TFDS dataset ``name`` vary in size (ImageNet's do)."""
    return None in tfds.builder(name, data_dir=data_dir).info.features["image"].shape


def prepare_encoded(
    name: str, data_dir: str | None, out_dir: str, splits: list[str], num_shards: int
) -> dict:
    """Writes splits of a TFDS dataset keeping its images' encoded bytes (JPEG stays JPEG).

    Read a shard's slice at a time (``split[start:stop]``), so memory stays flat.
    """
    from datasets.records import writing

    builder = tfds.builder(name, data_dir=data_dir)
    classes = list(builder.info.features["label"].names)
    skip = {"image": tfds.decode.SkipDecoding()}
    metadata = writing.start(out_dir)
    for split in splits:

        def items(start, stop, split=split):
            part = tfds.load(
                name,
                split=f"{split}[{start}:{stop}]",
                data_dir=data_dir,
                decoders=skip,
                download=False,
            )
            return ((e["image"], e["label"]) for e in tfds.as_numpy(part.take(stop - start)))

        load(name, split, data_dir, download=False)  # refuses data that is not there
        count = _count(builder, name, split, data_dir)
        writing.write_described(
            out_dir,
            metadata,
            split,
            items,
            count,
            min(num_shards, count),
            writing.plan_of(name, split, count, num_shards),
            classes,
            eval_split=next((s for s in splits if s != "train"), splits[0]),
            names=lambda i, split=split: f"{name} {split} example {i}",
        )
    return metadata


def _count(builder, name: str, split: str, data_dir: str | None) -> int:
    if split in builder.info.splits:
        return builder.info.splits[split].num_examples
    return int(tfds.load(name, split=split, data_dir=data_dir, download=False).cardinality())
