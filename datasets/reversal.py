"""Sequences to reverse, generated: the seed's sequence-to-sequence task, offline.

Example ``i`` is ``length`` random token ids (3 to ``vocab_size - 1``; 0 pads, 1 and 2
are ``models.seq2seq``'s BOS and EOS), ``length`` drawn from ``[shortest, longest]``;
its target is the sequence reversed, then EOS. Training draws ``count`` examples from
``seed``, evaluation ``eval_count`` from another seed; both are in-memory ragged
sources, read by index (``datasets.pipeline``) and batched by length as the
``lengths`` knobs say.
"""

from __future__ import annotations

import gin
import numpy as np
import tensorflow as tf

from datasets import pipeline
from trainer import InputParams, Mode

EOS = 2


def examples(count: int, vocab_size: int, shortest: int, longest: int, seed: int):
    """``{'tokens', 'targets'}`` ragged: ``count`` sequences and their reversals + EOS."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shortest, longest + 1, count)
    tokens = [rng.integers(3, vocab_size, n).tolist() for n in lengths]
    targets = [t[::-1] + [EOS] for t in tokens]
    return {
        "tokens": tf.ragged.constant(tokens, tf.int64),
        "targets": tf.ragged.constant(targets, tf.int64),
    }


_SOURCES: dict = {}


def _source_and_target(example):
    return {"tokens": example["tokens"]}, {"targets": example["targets"]}


@gin.configurable("reversal.input_fn")
def input_fn(
    mode: Mode,
    params: InputParams,
    count: int = 20_000,
    eval_count: int = 1_000,
    vocab_size: int = 12,
    shortest: int = 3,
    longest: int = 12,
) -> tf.data.Dataset:
    """Batches of ``({'tokens': [b, n]}, {'targets': [b, n + 1]})``, padded with 0."""
    training = mode == Mode.TRAIN
    key = (training, count if training else eval_count, vocab_size, shortest, longest)
    if key not in _SOURCES:
        seed = 0 if training else 1
        arrays = examples(key[1], vocab_size, shortest, longest, seed)
        _SOURCES[key] = pipeline.ArraySource(
            arrays, "reversal-train" if training else "reversal-eval"
        )
    return pipeline.build(_SOURCES[key], mode, params, _source_and_target, name=_SOURCES[key].name)
