"""Encoded images (JPEG, PNG, ...) in records: decoding, the ImageNet crops, the pipeline.

Records of encoded images are what ``python3 -m datasets.prepare --images`` writes
(each file's bytes as found, JPEG stays JPEG) and what other tools wrote (ImageNet's
build script: ``image/encoded``, ``image/class/label``). Their images vary in size,
so they are decoded one by one, in parallel, and brought to one size (``image_size``;
unset, data of one size keeps it whole):

* evaluation (and training without augmentation) takes the central 87.5% square
  (224/256: the shorter side resized to ``S * 256 / 224``, then the centre ``S x S``);
* ``augment = 'inception'`` is the random-resized crop of Inception and ResNet
  training: a window of 8-100% of the area and aspect 3/4-4/3, resized to ``S x S``,
  flipped half the time;
* ``augment = True`` pads, crops back and flips the evaluation image (CIFAR's).

For a JPEG only the window is decoded (``tf.io.decode_and_crop_jpeg``): decoding
costs grow with the pixels decoded. Every random choice is drawn from the example's
stream position (``seed``), so a resumed run draws the same crops.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from datasets import pipeline
from datasets.records import indexed
from trainer import InputParams, Mode, UserError
from trainer.serving import serves

ENCODED = "encoded"  # dataset.json's image_format of records holding encoded images
AUGMENTS = (False, True, "inception")
CENTRE = 224 / 256  # of the shorter side, the centre square evaluation takes
AREA = (0.08, 1.0)  # of the image, a training crop covers
ASPECT = (3 / 4, 4 / 3)  # width / height of a training crop


@tf.autograph.experimental.do_not_convert
def is_jpeg(data: tf.Tensor) -> tf.Tensor:
    """Whether encoded bytes are a JPEG (by its signature, not a file name)."""
    return tf.equal(tf.strings.substr(data, 0, 3), b"\xff\xd8\xff")


@tf.autograph.experimental.do_not_convert
def decode_window(data: tf.Tensor, window, channels: int) -> tf.Tensor:
    """The part of an encoded image ``window([height, width]) -> (begin, size)`` picks.

    A JPEG's size is read from its header and only the window is decoded; other
    formats (PNG, GIF, BMP) are decoded whole, then cut.
    """

    def jpeg():
        begin, size = window(tf.io.extract_jpeg_shape(data)[:2])
        crop = tf.stack([begin[0], begin[1], size[0], size[1]])
        return tf.io.decode_and_crop_jpeg(data, crop, channels=channels)

    def other():
        image = tf.io.decode_image(data, channels=channels, expand_animations=False)
        begin, size = window(tf.shape(image)[:2])
        return tf.slice(image, tf.concat([begin, [0]], 0), tf.concat([size, [channels]], 0))

    image = tf.cond(is_jpeg(data), jpeg, other)
    return tf.ensure_shape(image, [None, None, channels])


def centre_crop(data: tf.Tensor, size, channels: int) -> tf.Tensor:
    """float32 ``[*size, channels]`` in [0, 1]: the central ``CENTRE`` square, resized."""

    def window(shape):
        side = tf.cast(CENTRE * tf.cast(tf.reduce_min(shape), tf.float32), tf.int32)
        side = tf.maximum(side, 1)
        return (shape - side + 1) // 2, tf.stack([side, side])

    image = decode_window(data, window, channels)
    return pipeline.unit_range(tf.image.resize(image, size))


def random_resized_crop(data: tf.Tensor, seed: tf.Tensor, size, channels: int) -> tf.Tensor:
    """float32 ``[*size, channels]`` in [0, 1]: Inception's crop, resized, maybe flipped."""

    def window(shape):
        begin, crop, _ = tf.image.stateless_sample_distorted_bounding_box(
            tf.concat([shape, [channels]], 0),
            bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
            seed=seed,
            min_object_covered=0.1,
            aspect_ratio_range=ASPECT,
            area_range=AREA,
            max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        return begin[:2], crop[:2]

    image = tf.image.resize(decode_window(data, window, channels), size)
    image = tf.image.stateless_random_flip_left_right(image, seed + 1)
    return image / 255.0


@tf.autograph.experimental.do_not_convert
def pad_crop_flip(features: dict, labels: dict, seed: tf.Tensor, pad: int = 4):
    """Pads the image by ``pad`` pixels, crops a random window of its size, maybe flips it."""
    image = features["image"]
    height, width, channels = image.shape
    padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]], mode="REFLECT")
    cropped = tf.image.stateless_random_crop(padded, [height, width, channels], seed=seed)
    flipped = tf.image.stateless_random_flip_left_right(cropped, seed=seed + 1)
    return {**features, "image": flipped}, labels


def whole(data: tf.Tensor, shape) -> tf.Tensor:
    """float32 ``shape`` in [0, 1]: the whole image, for data of one image size."""
    image = tf.io.decode_image(data, channels=shape[-1], expand_animations=False)
    return pipeline.unit_range(tf.ensure_shape(image, shape))


@tf.autograph.experimental.do_not_convert
def central_square(image: tf.Tensor, size: int) -> tf.Tensor:
    """An image (or a batch) resized so its shorter side is ``size``, then its centre square."""
    shape = tf.cast(tf.shape(image)[-3:-1], tf.float32)
    scale = size / tf.reduce_min(shape)
    resized = tf.image.resize(image, tf.cast(tf.math.ceil(shape * scale), tf.int32))
    return tf.image.resize_with_crop_or_pad(resized, size, size)


@tf.autograph.experimental.do_not_convert
def square_features(stored: dict, size: int) -> dict:
    """The model's features of fixed-size images (one or a batch): the central square."""
    return {"image": central_square(pipeline.unit_range(stored["image"]), size)}


def output_size(metadata: dict, image_size: int | None, data_dir: str) -> list[int]:
    """``[height, width]`` of the model's images: ``image_size`` square, else as stored."""
    if image_size is not None:
        if int(image_size) < 1:
            raise UserError(f"tfrecord.input_fn.image_size must be >= 1, got {image_size}")
        return [int(image_size)] * 2
    if not metadata.get("image_shape"):
        raise UserError(
            f"the images in {data_dir} vary in size: give them one with "
            "tfrecord.input_fn.image_size = S (e.g. 224)"
        )
    return list(metadata["image_shape"][:2])


def read(
    data_dir: str,
    metadata: dict,
    paths: list[str],
    split: str,
    mode: Mode,
    params: InputParams,
    *,
    image_size: int | None = None,
    augment: bool | str = False,
    skip_corrupt: bool = False,
) -> tf.data.Dataset:
    """Batches of ``({'image': float32 [b, S, S, c] in [0, 1]}, {'label': int64 [b]})``.

    Reads by index the records of ``split`` (``indexed.RecordSource``); see the
    module's docstring for the crops. Marked with how an export serves them: the
    encoded bytes of one image each (``serving_default``), or the records.
    """
    if augment not in AUGMENTS:
        raise UserError(f"tfrecord.input_fn.augment must be one of {AUGMENTS}, got {augment!r}")
    size = output_size(metadata, image_size, data_dir)
    channels = int(metadata.get("channels", 3))
    image_key = metadata.get("image_key", "image")
    label_key = metadata.get("label_key", "label")
    offset = int(metadata.get("label_offset", 0))
    shards = metadata["splits"][split]["shards"]
    offsets = [
        indexed.record_offsets(path, shard["count"], skip_corrupt, index_path(data_dir, shard))
        for path, shard in zip(paths, shards, strict=True)
    ]
    features = {image_key: tf.io.FixedLenFeature([], tf.string)}
    features[label_key] = tf.io.FixedLenFeature([], tf.int64)

    @tf.autograph.experimental.do_not_convert
    def parse(record):
        example = tf.io.parse_single_example(record, features)
        return {"image": example[image_key], "label": example[label_key] + offset}

    source = pipeline.RecordExamples(indexed.RecordSource(paths, offsets), parse, split)
    crop, name = image_size is not None, f"{data_dir}:{split}"
    return batches(source, mode, params, size, channels, augment, name, crop, image_key)


def batches(
    source,
    mode: Mode,
    params: InputParams,
    size,
    channels: int,
    augment: bool | str,
    name: str,
    crop: bool = True,
    image_key: str | None = None,
    weights=None,
) -> tf.data.Dataset:
    """Batches of ``({'image'}, {'label'})`` from examples of encoded images.

    ``source`` (or a list of them, as ``pipeline.build`` takes) gives examples
    ``{'image': encoded bytes, 'label': int64}``, brought to ``size`` as the module's
    docstring says (``crop``; else each image whole), ``augment`` one of ``AUGMENTS``.
    ``image_key``: the records are ``tf.train.Example``s holding their image there,
    and an export takes such records too (``serving_examples``). ``weights``: several
    sources' shares of the training stream.
    """
    features_of = functools.partial(evaluated, size=size, channels=channels, crop=crop)
    training = mode == Mode.TRAIN
    if training and augment == "inception":
        preprocess = _stored
        augment_fn = functools.partial(_inception, size=size, channels=channels)
    else:
        preprocess = functools.partial(_decoded, features_of=features_of)
        augment_fn = pad_crop_flip if training and augment else None
    dataset = pipeline.build(
        source, mode, params, preprocess, augment=augment_fn, weights=weights, name=name
    )
    stored = {"image": tf.TensorSpec([], tf.string)}
    parser = _example_parser(image_key) if image_key else None
    return serves(dataset, features_of, stored, parser)


@tf.autograph.experimental.do_not_convert
def evaluated(stored: dict, size, channels: int, crop: bool = True) -> dict:
    """The model's features of one stored example: its centre crop, or the whole image."""
    if crop:
        return {"image": centre_crop(stored["image"], size, channels)}
    return {"image": whole(stored["image"], [*size, channels])}


def index_path(data_dir: str, shard: dict) -> str | None:
    """Where a shard's index lies: beside it, or in ``data_dir`` for others' shards."""
    if "index" not in shard:
        return None
    return tf.io.gfile.join(data_dir, shard["index"])


@tf.autograph.experimental.do_not_convert
def _stored(example: dict) -> tuple[dict, dict]:
    return {"image": example["image"]}, {"label": example["label"]}


@tf.autograph.experimental.do_not_convert
def _decoded(example: dict, features_of) -> tuple[dict, dict]:
    return features_of(example), {"label": example["label"]}


@tf.autograph.experimental.do_not_convert
def _inception(features: dict, labels: dict, seed: tf.Tensor, size, channels: int):
    return {"image": random_resized_crop(features["image"], seed, size, channels)}, labels


def _example_parser(image_key: str):
    @tf.autograph.experimental.do_not_convert
    def parse(serialized: tf.Tensor) -> dict:
        feature = {image_key: tf.io.FixedLenFeature([], tf.string)}
        return {"image": tf.io.parse_example(serialized, feature)[image_key]}

    return parse
