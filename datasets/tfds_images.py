"""Image classification datasets from TFDS: mnist, fashion_mnist, cifar10, cifar100.

``input_fn`` reads a prepared copy from ``data_dir`` (TFDS's default when None) and
downloads it when it is missing and the network is there. When it is missing and
cannot be downloaded, it says so in one line and how to get it, instead of the
downloader retrying for minutes. Splits take TFDS slicing, e.g. 'train[:90%]'.

Preprocessing: pixels scaled to [0, 1]; optionally per-image standardisation; in
training, optionally the CIFAR augmentation (pad by 4 to 40x40 for 32x32 images,
random crop back, random horizontal flip).
"""

from __future__ import annotations

import functools
import socket

import gin
import tensorflow as tf
import tensorflow_datasets as tfds

from datasets import pipeline
from trainer import InputParams, Mode, UserError

DOWNLOAD_HOST = "storage.googleapis.com"  # where TFDS keeps its prepared datasets


def preprocess(example: dict, standardize: bool = False) -> tuple[dict, dict]:
    """Scales ``image`` to [0, 1] (or standardises it); returns ``({'image'}, {'label'})``."""
    image = tf.cast(example["image"], tf.float32) / 255.0
    if standardize:
        image = tf.image.per_image_standardization(image)
    return {"image": image}, {"label": example["label"]}


def pad_crop_flip(features: dict, labels: dict, seed: tf.Tensor, pad: int = 4):
    """Pads the image by ``pad`` pixels, crops a random window of its size, maybe flips it."""
    image = features["image"]
    height, width, channels = image.shape
    padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]], mode="REFLECT")
    cropped = tf.image.stateless_random_crop(padded, [height, width, channels], seed=seed)
    flipped = tf.image.stateless_random_flip_left_right(cropped, seed=seed + 1)
    return {**features, "image": flipped}, labels


def load(
    name: str, split: str, data_dir: str | None = None, download: bool = True
) -> tf.data.Dataset:
    """The examples of ``split`` of TFDS dataset ``name``; downloads only when it can."""
    try:
        return tfds.load(name, split=split, data_dir=data_dir, download=False, shuffle_files=False)
    except (AssertionError, FileNotFoundError, tfds.core.registered.DatasetNotFoundError) as e:
        missing = e
    if isinstance(missing, tfds.core.registered.DatasetNotFoundError):
        raise UserError(f"TFDS has no dataset named {name!r}: see `tfds.list_builders()`") from None
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
            f"downloading dataset {name!r} failed ({str(error).splitlines()[0]}): {how}"
        ) from None


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
) -> tf.data.Dataset:
    """Batches of ``({'image': [b, h, w, c] in [0, 1]}, {'label': [b]})``.

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

    Shuffle buffer, caching and determinism are ``pipeline.*`` bindings.
    """
    split = train_split if mode == Mode.TRAIN else eval_split
    source = load(name, split, data_dir, download)
    return pipeline.build(
        source,
        mode,
        params,
        functools.partial(preprocess, standardize=standardize),
        augment=pad_crop_flip if augment else None,
        name=f"{name}-{split}",
    )
