"""Records of uncompressed TFRecord shards, read by their byte offsets.

Beside each shard ``write`` saves an index, ``SHARD.index``: one int64 ``.npy``
array of each record's byte offset, then the shard's size in bytes, then a masked
CRC-32C of what comes before it. An index is trusted only when its checksum and the
shard's size agree; a damaged or stale one is rebuilt by one checked pass over the
shard's records (with a warning), and a shard whose records are fewer or more than
``dataset.json`` lists is refused, as ``prepare --verify`` would. ``RecordSource``
then fetches any record with one ``pread`` and checks its CRC, naming the shard and
the offset of a corrupt one.
"""

from __future__ import annotations

import io
import os
import struct
import threading
from collections.abc import Sequence

import google_crc32c
import numpy as np
import tensorflow as tf
from absl import logging

from datasets import pipeline
from trainer import UserError, errors

INDEX_SUFFIX = ".index"
HEADER = 12  # a record: uint64 length, uint32 masked CRC of it, data, uint32 masked CRC


def write_index(path: str, offsets: np.ndarray) -> None:
    """Saves ``offsets`` of the shard at ``path`` beside it, with its size and a checksum."""
    body = np.append(np.asarray(offsets, np.int64), tf.io.gfile.stat(path).length)
    buffer = io.BytesIO()
    np.save(buffer, np.append(body, masked_crc(body.tobytes())).astype(np.int64))
    tmp = f"{path}{INDEX_SUFFIX}.tmp-{os.getpid()}"
    with tf.io.gfile.GFile(tmp, "wb") as f:
        f.write(buffer.getvalue())
    tf.io.gfile.rename(tmp, path + INDEX_SUFFIX, overwrite=True)


def record_offsets(path: str, expected: int, skip_corrupt: bool = False) -> np.ndarray:
    """The byte offset of each record of an uncompressed shard, from its index file.

    A shard without a sound index is indexed by one pass that checks every record;
    the index is saved beside it when the directory is writable. With
    ``skip_corrupt`` that pass is always made, and records from a corrupt one on are
    left out (and counted in the log); otherwise a corrupt record is refused here,
    or when it is read.

    Raises:
      UserError: a corrupt record, or a shard holding other than ``expected`` records.
    """
    offsets = None if skip_corrupt else _saved_offsets(path)
    if offsets is None:
        offsets = _index(path, expected, skip_corrupt)
    if len(offsets) != expected and not skip_corrupt:
        raise UserError(
            f"{path} holds {len(offsets)} records where dataset.json lists {expected}: "
            "re-copy the data files, or prepare the data again"
        )
    return offsets


def _saved_offsets(path: str) -> np.ndarray | None:
    """The offsets in the shard's index, or None when it has none that can be trusted."""
    index = path + INDEX_SUFFIX
    if not tf.io.gfile.exists(index):
        return None
    if tf.io.gfile.stat(index).mtime_nsec < tf.io.gfile.stat(path).mtime_nsec:
        logging.info("%s is older than its shard; indexing again", index)
        return None
    try:
        with tf.io.gfile.GFile(index, "rb") as f:
            saved = np.load(io.BytesIO(f.read()), allow_pickle=False)
    except (ValueError, OSError, EOFError, MemoryError):  # a damaged .npy header
        saved = None
    sound = (
        isinstance(saved, np.ndarray)
        and saved.dtype == np.int64
        and saved.ndim == 1
        and len(saved) >= 2
        and int(saved[-1]) == masked_crc(saved[:-1].tobytes())
        and int(saved[-2]) == tf.io.gfile.stat(path).length
    )
    if not sound:
        logging.warning("%s is damaged or out of date; indexing %s again", index, path)
        return None
    return saved[:-2]


def _index(path: str, expected: int, skip_corrupt: bool) -> np.ndarray:
    """The offsets found by one checked pass over the shard's records; saved if clean."""
    logging.info("Indexing the records of %s (once)", path)
    offsets, offset = [], 0
    try:
        for record in tf.data.TFRecordDataset(path):
            offsets.append(offset)
            offset += HEADER + len(record.numpy()) + 4
    except tf.errors.DataLossError as error:
        if not skip_corrupt:
            raise UserError(
                f"{path}: input data is corrupt ({errors.op_error_text(error)}) after "
                f"{len(offsets)} records; re-copy it, prepare the data again, or set "
                "tfrecord.input_fn.skip_corrupt = True"
            ) from None
        logging.warning(
            "Skipping %d unreadable records of %d in %s", expected - len(offsets), expected, path
        )
        return np.asarray(offsets, np.int64)  # not saved: the file may be repaired
    offsets = np.asarray(offsets, np.int64)
    try:
        write_index(path, offsets)
    except (OSError, tf.errors.OpError):
        logging.info("Could not save the index of %s; it is rebuilt at each start", path)
    return offsets


class RecordSource(pipeline.RandomAccess):
    """The records of one split's uncompressed shards, read by index.

    Args:
      paths: the shards, in order.
      offsets: each shard's record offsets (``record_offsets``).
    """

    def __init__(self, paths: Sequence[str], offsets: Sequence[np.ndarray]):
        self.paths = list(paths)
        self.offsets = [np.asarray(o, np.int64) for o in offsets]
        self.starts = np.concatenate([[0], np.cumsum([len(o) for o in self.offsets])])
        self._files: dict[int, object] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _read(self, rows: np.ndarray) -> tuple[np.ndarray, str]:
        shards = np.searchsorted(self.starts, rows, side="right") - 1
        records = []
        for row, shard in zip(rows.tolist(), shards.tolist(), strict=True):
            offset = int(self.offsets[shard][row - self.starts[shard]])
            header = self._pread(shard, HEADER, offset)
            (length,) = struct.unpack("<Q", header[:8]) if len(header) == HEADER else (-1,)
            body = self._pread(shard, length + 4, offset + HEADER) if length >= 0 else b""
            data, crc = body[:-4], body[-4:]
            if (
                length < 0
                or len(body) != length + 4
                or masked_crc(header[:8]) != struct.unpack("<I", header[8:])[0]
                or masked_crc(data) != struct.unpack("<I", crc)[0]
            ):
                where = f"corrupted record at {offset} in {self.paths[shard]}"
                return np.asarray(records + [b""] * (len(rows) - len(records)), object), where
            records.append(data)
        return np.asarray(records, object), ""

    def _pread(self, shard: int, size: int, offset: int) -> bytes:
        handle = self._files.get(shard)
        if handle is None:
            with self._lock:
                handle = self._files.get(shard) or _open(self.paths[shard])
                self._files[shard] = handle
        if isinstance(handle, int):  # a local file: positional reads need no lock
            return os.pread(handle, size, offset)
        with self._lock:
            handle.seek(offset)
            return handle.read(size)


def in_order(source: RecordSource, pipelines: int = 1, pipeline_id: int = 0, chunk=1024):
    """Every record of ``source`` once, in order (this pipeline's share), read by offset."""
    rows = tf.data.Dataset.range(len(source)).shard(pipelines, pipeline_id).batch(chunk)
    return rows.map(source.read).unbatch()


def _open(path: str):
    """A file descriptor for local paths, else a tf.io.gfile handle (cloud storage)."""
    if "://" not in path:
        return os.open(path, os.O_RDONLY)
    return tf.io.gfile.GFile(path, "rb")


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
