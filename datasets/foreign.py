"""TFRecord shards written by other tools, read where they lie.

ImageNet is most often held in the layout of the TensorFlow models build script:
``train-00000-of-01024`` ... and ``validation-00000-of-00128``, each record a
``tf.train.Example`` with ``image/encoded`` (JPEG) and ``image/class/label`` counted
from 1. ``index`` describes such shards in a prepared directory without copying
them (they may sit on read-only storage)::

    python3 -m datasets.prepare --tfrecords '/imagenet/train-*' --split train
        --image_key image/encoded --label_key image/class/label --label_offset -1
        --out data/imagenet     (one line; then --split validation the same way)

One pass over each shard, a thread per core, finds every record's offset and checks
that each has both keys; the offsets are saved in the prepared directory
(``SPLIT-SHARD.index``) and ``dataset.json`` lists the shards by their path, so
training reads them by index like the framework's own.
"""

from __future__ import annotations

import concurrent.futures
import os

import numpy as np
import tensorflow as tf
from absl import logging

from datasets import images
from datasets.records import indexed, shards, writing
from trainer import UserError, errors, whole_files


def index(
    pattern: str,
    split: str,
    out_dir: str,
    image_key: str = "image/encoded",
    label_key: str = "image/class/label",
    label_offset: int = 0,
) -> dict:
    """Indexes the shards ``pattern`` matches as ``split``; returns ``dataset.json``."""
    paths = sorted(tf.io.gfile.glob(pattern))
    if not paths:
        raise UserError(f"--tfrecords {pattern!r} matches no file")
    names = [os.path.basename(p) for p in paths]
    if len(set(names)) < len(names):
        raise UserError(f"--tfrecords {pattern!r} matches files of one name in several folders")
    metadata = writing.start(out_dir)
    keys = {"image_key": image_key, "label_key": label_key, "label_offset": label_offset}
    for key, value in keys.items():
        if metadata.get(key, value) != value:
            raise UserError(
                f"{out_dir} was prepared with --{key} {metadata[key]}, not {value}: "
                "give the same keys for every split, or another --out"
            )
    logging.info("%s: indexing %d shards", split, len(paths))
    workers = os.cpu_count() or 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        found = list(pool.map(lambda p: _scan(p, image_key, label_key), paths))
    labels = [(low, high) for _, low, high in found if low is not None]
    if not labels:
        raise UserError(f"--tfrecords {pattern!r}: the shards hold no records")
    low, high = min(x for x, _ in labels) + label_offset, max(x for _, x in labels) + label_offset
    if low < 0:
        raise UserError(
            f"{pattern}: labels start at {low - label_offset}; with --label_offset "
            f"{label_offset} a class id would be {low}: give --label_offset {-(low - label_offset)}"
        )
    entries = []
    for path, name, (offsets, _, _) in zip(paths, names, found, strict=True):
        index_name = f"{split}-{name}{indexed.INDEX_SUFFIX}"
        indexed.write_index(path, offsets, os.path.join(out_dir, index_name))
        size = tf.io.gfile.stat(path).length
        entries.append({"file": path, "count": len(offsets), "bytes": size, "index": index_name})
    splits = metadata.setdefault("splits", {})
    splits[split] = {"shards": entries, "count": sum(e["count"] for e in entries)}
    metadata.update(
        keys,
        image_format=images.ENCODED,
        image_shape=None,
        channels=3,
        compression=None,
        num_classes=max(high + 1, metadata.get("num_classes") or 0),
    )
    if split != "train":
        metadata["eval_split"] = split
    whole_files.write_json(os.path.join(out_dir, shards.METADATA), metadata)
    return metadata


def _scan(path: str, image_key: str, label_key: str):
    """``(record offsets, lowest label, highest label)`` of one shard, by one checked pass."""
    with tf.io.gfile.GFile(path, "rb") as f:
        if f.read(2) == b"\x1f\x8b":
            raise UserError(
                f"{path} is compressed (GZIP): only uncompressed shards are read by index"
            )
    features = {
        image_key: tf.io.FixedLenFeature([], tf.string),
        label_key: tf.io.FixedLenFeature([], tf.int64),
    }
    offsets, offset, low, high = [], 0, None, None
    try:
        for batch in tf.data.TFRecordDataset(path).batch(1024):
            lengths = tf.strings.length(batch).numpy()
            labels = tf.io.parse_example(batch, features)[label_key].numpy()
            starts = offset + np.concatenate([[0], np.cumsum(lengths + indexed.HEADER + 4)])
            offsets.extend(starts[:-1].tolist())
            offset = int(starts[-1])
            low = int(labels.min()) if low is None else min(low, int(labels.min()))
            high = int(labels.max()) if high is None else max(high, int(labels.max()))
    except tf.errors.DataLossError as error:
        raise UserError(
            f"{path}: input data is corrupt ({errors.op_error_text(error)}) after {len(offsets)} "
            "records; re-copy it"
        ) from None
    except tf.errors.InvalidArgumentError as error:
        raise UserError(
            f"{path}: a record has no {image_key!r} bytes or {label_key!r} integer "
            f"({errors.op_error_text(error)}): give --image_key and --label_key as the "
            "records name them"
        ) from None
    return np.asarray(offsets, np.int64), low, high
