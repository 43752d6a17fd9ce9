"""Writing sharded TFRecord files of fixed-shape images, and their ``dataset.json``.

A prepared directory holds ``dataset.json`` (shapes, format, classes, per-shard
counts and bytes) and the shards ``SPLIT-0000k-of-0000n.tfrecord`` (``.gz`` with
GZIP), each with its records' offsets beside it (``indexed.write_index``). Files are
written under temporary names and renamed when whole; ``dataset.json`` is written
last. ``datasets/records/tfrecord.py`` reads them; ``datasets/folders.py`` writes encoded
images the same way.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable

import numpy as np
import tensorflow as tf

from datasets.records import indexed
from trainer import UserError, owned_dirs, whole_files

METADATA = "dataset.json"
VOCABULARIES = ("vocab.txt", "sentencepiece.model")  # a text tokenizer's, kept beside
# a reference model's log-probabilities of prepared pairs, by split (datasets/chat/scores.py)
SCORES, SCORED = "reference.json", "{split}-reference.npy"
FORMATS = ("png", "raw")


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
    count: int | None = None,
) -> dict:
    """Writes ``{'image': uint8 [h, w, c], 'label': int}`` examples as ``num_shards`` files.

    With ``count`` given, ``examples`` is read as a stream (memory does not grow with
    the data); otherwise it is listed first. Files are written under temporary names
    and renamed when complete; ``dataset.json`` is updated last. Returns this split's
    metadata.
    """
    if image_format not in FORMATS:
        raise UserError(f"image format must be one of {FORMATS}, got {image_format!r}")
    if count is None:
        examples = list(examples)
        count = len(examples)
    if not count:
        raise UserError(f"split {split!r} has no examples to write")
    stream = iter(examples)
    owned_dirs.check(out_dir, OWNER)
    tf.io.gfile.makedirs(out_dir)
    options = tf.io.TFRecordOptions(compression_type=compression or "")
    sizes = [len(block) for block in np.array_split(np.arange(count), num_shards)]
    shards, shape, number = [], None, 0
    for index, size in enumerate(sizes):
        name = shard_name(split, index, num_shards, compression)
        path = os.path.join(out_dir, name)
        offsets, offset = [], 0
        with tf.io.TFRecordWriter(path + ".tmp", options) as writer:
            for example in itertools.islice(stream, size):
                image = np.asarray(example["image"], np.uint8)
                shape = shape or image.shape
                if image.shape != shape:
                    raise UserError(
                        f"example {number} of {split!r} has shape {image.shape}, "
                        f"the first had {shape}: images must share one shape"
                    )
                record = _example(image, int(example["label"]), image_format)
                writer.write(record)
                offsets.append(offset)
                offset += indexed.HEADER + len(record) + 4
                number += 1
        tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
        if not compression:
            indexed.write_index(path, np.asarray(offsets, np.int64))
        shards.append({"file": name, "count": len(offsets), "bytes": tf.io.gfile.stat(path).length})
    entry = {"shards": shards, "count": number}
    metadata = read_metadata(out_dir, missing_ok=True) or {}
    metadata.update(
        image_shape=list(shape),
        image_format=image_format,
        compression=compression,
        num_classes=num_classes,
    )
    metadata.setdefault("splits", {})[split] = entry
    whole_files.write_json(os.path.join(out_dir, METADATA), metadata)
    return entry


def read_metadata(data_dir: str, missing_ok: bool = False) -> dict | None:
    """The ``dataset.json`` of ``data_dir`` (None if missing and ``missing_ok``)."""
    path = os.path.join(data_dir, METADATA)
    try:
        metadata = whole_files.read_json(path)
    except whole_files.Unreadable as error:
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


def files_of(data_dir: str) -> set[str]:
    """The names of the files ``prepare`` wrote in ``data_dir``, as its ``dataset.json`` lists.

    Shards (and their indexes), each split's kept lengths and token stream (and
    prepared chats' answers and template; pairs' reference scores), a kept vocabulary,
    the resume records of a split being written, and ``dataset.json``: only plain
    names in ``data_dir`` (shards indexed where they lie are not its own).
    """
    metadata = read_metadata(data_dir, missing_ok=True) or {}
    names = {METADATA, *VOCABULARIES, SCORES, metadata.get("chat_template", "")}
    for split, entry in metadata.get("splits", {}).items():
        names.update({f"{split}.progress.json", SCORED.format(split=split)})
        for shard in entry.get("shards", []):  # an index beside it, or named (indexed in place)
            names.update({shard["file"], shard["file"] + indexed.INDEX_SUFFIX})
            names.add(shard.get("index", ""))
        names.update({entry.get("lengths", ""), entry.get("stream", {}).get("file", "")})
        names.add(entry.get("answers", ""))  # prepared chats': where each answer starts
    present = {name.rstrip("/") for name in tf.io.gfile.listdir(data_dir)}
    return {name for name in names if name and os.sep not in name} & present


# prepare, as the writer of the directories --out names (trainer/owned_dirs.py)
OWNER = owned_dirs.Owner("prepare", "--out", METADATA, files_of, ".progress.json")


def count_readable(path: str, compression: str | None) -> tuple[int, bool]:
    """(records read before the first error, whether the file read to its end cleanly)."""
    count = 0
    try:
        for _ in tf.data.TFRecordDataset(path, compression_type=compression or ""):
            count += 1
    except tf.errors.DataLossError:
        return count, False
    return count, True


def eval_split(metadata: dict) -> str:
    """The split ``dataset.json`` names for evaluation ('validation' for ImageNet)."""
    return metadata.get("eval_split", "test")


def check_shards(data_dir: str, split: str | None) -> tuple[dict, list[str]]:
    """The metadata and shard paths of ``split``, after checking each file exists at full size.

    ``split`` None is the evaluation split ``dataset.json`` names (``eval_split``).
    """
    metadata = read_metadata(data_dir)
    split = split or eval_split(metadata)
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


def verify(data_dir: str, split: str) -> list[str]:
    """Reads every record of ``split``; returns one line per damaged shard (none: all good)."""
    metadata, paths = check_shards(data_dir, split)
    problems = []
    for path, shard in zip(paths, metadata["splits"][split]["shards"], strict=True):
        count, clean = count_readable(path, metadata["compression"])
        if not clean or count != shard["count"]:
            problems.append(f"{path}: {count} of {shard['count']} records readable")
    return problems
