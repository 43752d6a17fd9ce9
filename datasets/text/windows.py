"""A language model's windows: a split's documents end to end, cut into rows of ``length``.

Each window's targets are its tokens shifted by one; the stream holds the end-of-
document id between documents, so the model sees where one ends. Held in memory when
they fit, else each window read from the split's token stream on disk by its offset
(``TokenWindows``): read by index either way, resumed exactly.
"""

from __future__ import annotations

import os

import gin
import numpy as np
import tensorflow as tf
from absl import logging

from datasets import pipeline
from datasets.records import shards
from datasets.sources import memory_limit
from datasets.text.input_fns import documents, next_tokens
from datasets.text.serving import served
from trainer import InputParams, Mode, UserError, errors


def windows(
    tokens: list[np.ndarray], length: int, name: str = "text", end: int | None = None
) -> pipeline.ArraySource:
    """A causal language model's examples: the documents end to end, cut into windows.

    Each document followed by ``end``, the id that says it ended, if given (a stream
    that holds them already, as prepare writes it, is given as one document). Window
    ``i`` is ``tokens[i * length : (i + 1) * length]`` of the concatenation, its
    targets the same shifted by one; the tail too short for a window is left out (the
    log says how many tokens). An ``ArraySource``: read by index, resumed exactly.
    """
    if end is not None:
        tokens = [part for document in tokens for part in (document, np.asarray([end]))]
    stream = np.concatenate(tokens) if tokens else np.zeros([0], np.int64)
    stream = stream.astype(np.int64, copy=False)  # a kept stream's ids are 2 bytes
    count = window_count(len(stream), length, name)
    used = stream[: count * length + 1]
    inputs = used[:-1].reshape(count, length)
    return pipeline.ArraySource(
        {"tokens": inputs, "targets": used[1:].reshape(count, length)}, name
    )


def window_count(tokens: int, length: int, name: str) -> int:
    """How many windows of ``length`` (and the next token) ``tokens`` make; said in the log."""
    count = (tokens - 1) // length
    if count < 1:
        raise UserError(
            f"{name}: {tokens} tokens make no window of {length} (and its next token): "
            "give a shorter window, or more text"
        )
    logging.info(
        "%s: %d tokens in %d windows of %d (the last %d tokens left out)",
        name,
        tokens,
        count,
        length,
        tokens - count * length - 1,
    )
    return count


class TokenWindows(pipeline.RandomAccess):
    """A language model's windows read by offset from a split's token stream on disk.

    The stream is the split's documents end to end (``SPLIT-tokens.bin``, which prepare
    writes); window ``i``'s record is its ``length + 1`` ids from ``i * length`` on, one
    read of a memory-mapped file: the same windows as ``windows``, without holding the
    text. Memory does not grow with the text, and a read does not grow with its size or
    with the step a run resumes at.
    """

    def __init__(self, path: str, dtype: str, tokens: int, length: int, name: str):
        self.dtype, self.length = np.dtype(dtype), int(length)
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != tokens * self.dtype.itemsize:
            raise UserError(
                f"{path} should hold the {tokens:,} tokens dataset.json lists, as "
                f"{dtype}; it is {'missing' if size is None else f'{size:,} bytes'}: re-copy "
                "it with the shards, or prepare the data again"
            )
        self.path, self.count = path, window_count(tokens, length, name)
        self._mapped = None  # opened at the first read, in the process that reads

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        """Bytes the windows take in memory, as int64 tokens and targets."""
        return 16 * self.count * self.length

    def stream(self) -> np.ndarray:
        """The whole stream, read into memory."""
        return np.fromfile(self.path, self.dtype)

    def _read(self, rows: np.ndarray) -> tuple[np.ndarray, str]:
        if self._mapped is None:
            self._mapped = np.memmap(self.path, self.dtype, mode="r")
        found = np.empty(len(rows), object)
        for i, row in enumerate(rows.tolist()):
            found[i] = self._mapped[row * self.length : (row + 1) * self.length + 1].tobytes()
        return found, ""

    @tf.autograph.experimental.do_not_convert
    def parse(self, record: tf.Tensor) -> dict:
        """A window's ``{'tokens', 'targets'}``, int64 ``[length]`` each."""
        ids = tf.cast(tf.io.decode_raw(record, tf.as_dtype(self.dtype)), tf.int64)
        ids.set_shape([self.length + 1])
        return {"tokens": ids[:-1], "targets": ids[1:]}


@gin.configurable("text.windows_input_fn")
def windows_input_fn(
    mode: Mode,
    params: InputParams,
    data_dir: str = gin.REQUIRED,
    length: int = 256,
    train_split: str = "train",
    eval_split: str | None = None,
) -> tf.data.Dataset:
    """A language model's batches: ``({'tokens': [b, length]}, {'targets': [b, length]})``.

    The prepared split's documents end to end, cut into windows (``windows``): TRAIN
    reads ``train_split``'s by index forever, EVAL and PREDICT ``eval_split``'s once.
    Held in memory when they fit ``pipeline.memory_limit_mb``; else each window is
    read from the split's token stream on disk by its offset (``TokenWindows``).
    """
    errors.check_count("text.windows_input_fn.length", length)
    wanted = train_split if mode == Mode.TRAIN else eval_split
    metadata, _ = shards.check_shards(data_dir, wanted)
    split = wanted or shards.eval_split(metadata)
    limit = memory_limit(pipeline.options())
    key = (os.path.abspath(data_dir), split, length, limit)
    if key not in _WINDOWS:  # made once a process: every later input_fn call reuses it
        _WINDOWS[key] = _windows_of(data_dir, metadata["splits"][split], split, length, limit)
    dataset = pipeline.build(_WINDOWS[key], mode, params, next_tokens, name=f"windows-{split}")
    return served(dataset, data_dir, length, keep_last=True)


def _windows_of(data_dir: str, entry: dict, split: str, length: int, limit: float):
    """A split's windows: in memory when they fit in ``limit`` bytes, else read by offset.

    From its token stream on disk; data prepared before streams were kept has its
    documents read into memory.
    """
    name = f"text-{split}"
    if "stream" not in entry:
        return windows(documents(data_dir, split), length, name)
    stream = entry["stream"]
    if "end" not in stream:
        logging.warning(
            "%s was prepared before each document's end was marked: a language model's "
            "windows run from one document into the next unmarked; prepare it again",
            data_dir,
        )
    path = os.path.join(data_dir, stream["file"])
    tokens = stream.get("tokens", entry["tokens"])  # the documents' and their ends
    on_disk = TokenWindows(path, stream["dtype"], tokens, length, name)
    if on_disk.nbytes > limit:
        return pipeline.RecordExamples(on_disk, on_disk.parse, name)
    return windows([on_disk.stream()], length, name)


_WINDOWS: dict = {}
