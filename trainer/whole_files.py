"""Small files written whole or not at all: configs, results, rankings, metadata.

Each write goes to a temporary name beside the target and is renamed over it when
complete, so a reader (or a rerun after a crash) never sees half a file. Paths go
through ``tf.io.gfile``, so the same code writes to local disks and cloud buckets.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import tensorflow as tf

from trainer.errors import UserError, first_line


def write_atomically(path: str, chunks: str | bytes | Iterable[str]) -> int:
    """Writes ``chunks`` (one string or bytes, or many strings) to ``path``; how many written."""
    tmp = f"{path}.tmp-{os.getpid()}"
    count = 0
    binary, whole = isinstance(chunks, bytes), isinstance(chunks, str | bytes)
    try:
        with tf.io.gfile.GFile(tmp, "wb" if binary else "w") as f:
            f.write(b"" if binary else "")  # GFile makes the file at its first write
            for chunk in [chunks] if whole else chunks:
                f.write(chunk)
                count += 1
        tf.io.gfile.rename(tmp, path, overwrite=True)
    finally:
        if tf.io.gfile.exists(tmp):
            tf.io.gfile.remove(tmp)
    return count


def write_json(path: str, value) -> None:
    """``value`` as indented JSON at ``path``, atomically."""
    write_atomically(path, json.dumps(value, indent=2) + "\n")


def read_json(path: str, default=None):
    """The JSON value at ``path``, or ``default`` when there is no such file.

    Raises:
      Unreadable: the file is there but is not JSON (damaged, or not ours).
    """
    if not tf.io.gfile.exists(path):
        return default
    try:
        with tf.io.gfile.GFile(path) as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise Unreadable(path, error) from None


class Unreadable(UserError):
    """A file the trainer wrote (or a user gave) that does not parse; names it and why."""

    def __init__(self, path: str, error: Exception):
        super().__init__(f"{path} is unreadable ({first_line(error)})")
        self.path = path
