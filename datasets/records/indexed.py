"""Records of uncompressed TFRecord shards, read by their byte offsets.

Beside each shard ``write`` saves an index, ``SHARD.index``: one int64 ``.npy``
array of each record's byte offset, then the shard's size in bytes, then a masked
CRC-32C of what comes before it. An index is trusted only when its checksum and the
shard's size agree; a damaged or stale one is rebuilt by one checked pass over the
shard's records (with a warning), and a shard whose records are fewer or more than
``dataset.json`` lists is refused, as ``prepare --verify`` would. ``RecordSource``
then fetches any record with one ``pread`` and checks its CRC, naming the shard and
the offset of a corrupt one. It keeps at most ``MAX_OPEN_FILES`` shards open at
once (ImageNet has 1,024 training shards, the usual limit of open files), closing the
least recently used one that no read is using.

A shard written by other tools may lie in a directory this process cannot write to:
its index is then kept elsewhere (``index_path``), in the prepared directory.
"""

from __future__ import annotations

import io
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

import google_crc32c
import numpy as np
import tensorflow as tf
from absl import logging

from datasets import pipeline
from trainer import UserError, errors

INDEX_SUFFIX = ".index"
HEADER = 12  # a record: uint64 length, uint32 masked CRC of it, data, uint32 masked CRC
MAX_OPEN_FILES = 128  # shards a RecordSource keeps open at once


def write_index(path: str, offsets: np.ndarray, index_path: str | None = None) -> None:
    """Saves ``offsets`` of the shard at ``path`` (beside it), with its size and a checksum."""
    index_path = index_path or path + INDEX_SUFFIX
    body = np.append(np.asarray(offsets, np.int64), tf.io.gfile.stat(path).length)
    buffer = io.BytesIO()
    np.save(buffer, np.append(body, masked_crc(body.tobytes())).astype(np.int64))
    tmp = f"{index_path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with tf.io.gfile.GFile(tmp, "wb") as f:
        f.write(buffer.getvalue())
    tf.io.gfile.rename(tmp, index_path, overwrite=True)


def record_offsets(
    path: str, expected: int, skip_corrupt: bool = False, index_path: str | None = None
) -> np.ndarray:
    """The byte offset of each record of an uncompressed shard, from its index file.

    A shard without a sound index is indexed by one pass that checks every record;
    the index is saved beside it (or at ``index_path``) when that is writable. With
    ``skip_corrupt`` that pass is always made, and records from a corrupt one on are
    left out (and counted in the log); otherwise a corrupt record is refused here,
    or when it is read.

    Raises:
      UserError: a corrupt record, or a shard holding other than ``expected`` records.
    """
    index_path = index_path or path + INDEX_SUFFIX
    offsets = None if skip_corrupt else saved_offsets(path, index_path)
    if offsets is None:
        offsets = _index(path, expected, skip_corrupt, index_path)
    if len(offsets) != expected and not skip_corrupt:
        raise UserError(
            f"{path} holds {len(offsets)} records where dataset.json lists {expected}: "
            "re-copy the data files, or prepare the data again"
        )
    return offsets


def saved_offsets(path: str, index: str) -> np.ndarray | None:
    """The offsets in the shard's index, or None when it has none that can be trusted."""
    if not tf.io.gfile.exists(index):
        return None
    if tf.io.gfile.stat(index).mtime_nsec < tf.io.gfile.stat(path).mtime_nsec:
        logging.warning("%s changed since its index %s was made; indexing it again", path, index)
        return None
    try:
        with tf.io.gfile.GFile(index, "rb") as f:
            saved = np.load(io.BytesIO(f.read()), allow_pickle=False)
    except Exception:  # a damaged .npy header fails in many ways (a TokenError too)
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


def _index(path: str, expected: int, skip_corrupt: bool, index_path: str) -> np.ndarray:
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
        write_index(path, offsets, index_path)
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
        self.files = OpenFiles(self.paths)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        """About the bytes the records take (their offsets say, with no file read)."""
        return int(sum(offsets[-1] for offsets in self.offsets if len(offsets)))

    def _read(self, rows: np.ndarray) -> tuple[np.ndarray, str]:
        shards = np.searchsorted(self.starts, rows, side="right") - 1
        records = []
        for row, shard in zip(rows.tolist(), shards.tolist(), strict=True):
            offset = int(self.offsets[shard][row - self.starts[shard]])
            data = self._record(shard, offset)
            if data is None:
                where = f"corrupted record at {offset} in {self.paths[shard]}"
                return np.asarray(records + [b""] * (len(rows) - len(records)), object), where
            records.append(data)
        return np.asarray(records, object), ""

    def _record(self, shard: int, offset: int) -> bytes | None:
        """The record at ``offset`` of ``shard``, or None when it is corrupt.

        The length is trusted only once its own CRC holds: a flipped bit there would
        otherwise be a read of gigabytes.
        """
        header = self.files.pread(shard, HEADER, offset)
        if len(header) != HEADER or masked_crc(header[:8]) != struct.unpack("<I", header[8:])[0]:
            return None
        (length,) = struct.unpack("<Q", header[:8])
        body = self.files.pread(shard, length + 4, offset + HEADER)
        data, crc = body[:-4], body[-4:]
        if len(body) != length + 4 or masked_crc(data) != struct.unpack("<I", crc)[0]:
            return None
        return data


class OpenFiles:
    """Positional reads from many files, with at most ``MAX_OPEN_FILES`` open at once.

    Reads run in parallel (tf.data calls ``RecordSource.read`` from several threads);
    a file is closed, least recently used first, only when no read is using it.
    """

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)
        self._open: OrderedDict[int, object] = OrderedDict()  # index -> fd or GFile
        self._using: dict[int, int] = {}
        self._lock = threading.Lock()

    def pread(self, index: int, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` of file ``index`` (fewer at its end)."""
        with self._lock:
            handle = self._open.pop(index, None)
            if handle is None:
                handle = _open(self.paths[index])
            self._open[index] = handle  # the most recently used, last
            self._using[index] = self._using.get(index, 0) + 1
            self._close_idle()
        try:
            if isinstance(handle, int):  # a local file: positional reads need no lock
                return os.pread(handle, size, offset)
            with self._lock:
                handle.seek(offset)
                return handle.read(size)
        finally:
            with self._lock:
                self._using[index] -= 1

    def _close_idle(self) -> None:
        """Closes the least recently used files no read is using, down to the limit."""
        for index in list(self._open):
            if len(self._open) <= MAX_OPEN_FILES:
                return
            if not self._using.get(index):
                _close(self._open.pop(index))

    def close(self) -> None:
        """Closes every file (a later read opens its file again)."""
        with self._lock:
            for index in [i for i in self._open if not self._using.get(i)]:
                _close(self._open.pop(index))

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit the modules it needs may be gone
            pass

    @property
    def open_count(self) -> int:
        """Files open now."""
        return len(self._open)


def in_order(source: RecordSource, pipelines: int = 1, pipeline_id: int = 0, chunk=1024):
    """Every record of ``source`` once, in order (this pipeline's share), read by offset."""
    rows = tf.data.Dataset.range(len(source)).shard(pipelines, pipeline_id).batch(chunk)
    return rows.map(source.read).unbatch()


def _open(path: str):
    """A file descriptor for local paths, else a tf.io.gfile handle (cloud storage)."""
    if "://" not in path:
        return os.open(path, os.O_RDONLY)
    return tf.io.gfile.GFile(path, "rb")


def _close(handle) -> None:
    if isinstance(handle, int):
        os.close(handle)
    else:
        handle.close()


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C of ``data``."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
