"""TensorBoard event files: one writer per directory, scalars and text."""

from __future__ import annotations

import os
from collections.abc import Mapping

import tensorflow as tf


class Writers:
    """Creates one ``tf.summary`` file writer per subdirectory of ``model_dir``, lazily."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._writers: dict[str, tf.summary.SummaryWriter] = {}

    def get(self, name: str) -> tf.summary.SummaryWriter:
        """The writer of ``model_dir/name`` (``train``, ``eval_test``, ...)."""
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(os.path.join(self.model_dir, name))
        return self._writers[name]

    def scalars(self, name: str, step: int, values: Mapping[str, float]) -> None:
        """Writes each value as a scalar under its key, at ``step``."""
        writer = self.get(name)
        with writer.as_default(step=step):
            for key, value in values.items():
                tf.summary.scalar(key, value)
        writer.flush()

    def text(self, name: str, tag: str, text: str, step: int) -> None:
        """Writes ``text`` as a preformatted block (TensorBoard renders markdown)."""
        writer = self.get(name)
        block = "\n".join("    " + line for line in text.splitlines())
        with writer.as_default(step=step):
            tf.summary.text(tag, block)
        writer.flush()

    def close(self) -> None:
        """Flushes and closes every writer."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
