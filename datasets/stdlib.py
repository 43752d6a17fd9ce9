"""The Python standard library's own modules as text: real, offline, on every machine.

Its top-level modules (``*.py`` beside ``os.py``, found through ``sysconfig``), in
order of name; every tenth is held out as ``test``, the rest are ``train``. Text no
one here wrote, and the same on every machine with the same Python (3.11: 168
modules, 4.7 MB). Each byte is a token, ids 1 to 256 (0 pads), as
``datasets.prepare --text`` makes them with ``--tokenizer bytes``.

``input_fn`` reads a language model's windows of a split (``text.windows``): the
modules end to end, cut into windows of ``length`` bytes, each with its next bytes as
``targets``; an in-memory source, read by index and resumed exactly. In PREDICT it
gives ``prompts``, so that ``--schedule predict`` continues them.
``bigram_bits_per_byte`` is the baseline a model must beat.
"""

from __future__ import annotations

import os
import sysconfig

import gin
import numpy as np
import tensorflow as tf

from datasets import pipeline, text
from trainer import InputParams, Mode, UserError


def modules(split: str) -> list[str]:
    """The paths of a split's modules: ``'train'``, or ``'test'`` (every tenth)."""
    root = sysconfig.get_paths()["stdlib"]
    found = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    if not found:
        raise UserError(f"no Python modules in {root}, the standard library sysconfig names")
    held_out = {"train": False, "test": True}[split]
    return [os.path.join(root, f) for i, f in enumerate(found) if (i % 10 == 9) == held_out]


def byte_ids(paths: list[str]) -> list[np.ndarray]:
    """Each file's bytes as token ids (byte + 1)."""
    found = []
    for path in paths:
        with open(path, "rb") as f:
            found.append(np.frombuffer(f.read(), np.uint8).astype(np.int64) + 1)
    return found


def bigram_bits_per_byte() -> dict[str, float]:
    """Add-one unigram and bigram models of ``train``, in bits per byte of ``test``."""
    train, test = (np.concatenate(byte_ids(modules(s))) - 1 for s in ("train", "test"))
    unigram = np.bincount(train, minlength=256) + 1.0
    pairs = np.zeros([256, 256]) + 1.0
    np.add.at(pairs, (train[:-1], train[1:]), 1.0)
    conditional = pairs / pairs.sum(axis=1, keepdims=True)
    return {
        "unigram": float(-np.log2(unigram[test] / unigram.sum()).mean()),
        "bigram": float(-np.log2(conditional[test[:-1], test[1:]]).mean()),
    }


_WINDOWS: dict = {}


@gin.configurable("stdlib.input_fn")
def input_fn(
    mode: Mode,
    params: InputParams,
    length: int = 128,
    prompts: tuple[str, ...] = ("def main(",),
) -> tf.data.Dataset:
    """A byte-level language model's batches of the standard library's modules.

    TRAIN: ``({'tokens': [b, length]}, {'targets': [b, length]})`` windows of
    ``train``, by index forever; EVAL: ``test``'s windows once; PREDICT: ``prompts``
    as ``{'tokens'}``, padded with 0, for a model that continues them.
    """
    if mode == Mode.PREDICT:
        ids = tf.ragged.constant([[b + 1 for b in p.encode()] for p in prompts], tf.int64)
        source = pipeline.ArraySource({"tokens": ids}, "prompts")
        return pipeline.build(source, mode, params, lambda e: ({"tokens": e["tokens"]}, {}))
    split = "train" if mode == Mode.TRAIN else "test"
    if (split, length) not in _WINDOWS:  # read once a process
        _WINDOWS[split, length] = text.windows(byte_ids(modules(split)), length, f"stdlib-{split}")
    windows = _WINDOWS[split, length]
    return pipeline.build(windows, mode, params, text.next_tokens, name=f"stdlib-{split}")
