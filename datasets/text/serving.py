"""Prepared text served: an export takes strings and tokenizes them as training did.

``served`` marks a dataset with what its export takes (``STORED``: one string an
example) and the tokenizer of its ``data_dir``, made once a process; the export runs
``TextFeatures``, the same ops the shards were made with (and packs a prompt's
segments where training packed).
"""

from __future__ import annotations

import os

import tensorflow as tf

from datasets import packing
from datasets.records import shards
from datasets.text.tokenizers import KEPT, Tokenizer, read_vocabulary, sentencepiece
from trainer import serving

STORED = {"text": tf.TensorSpec([], tf.string)}  # what an export of prepared text takes


class TextFeatures(tf.Module):
    """An export's preprocessing: strings ``{'text': [batch]}`` to the model's features.

    Tokenized as ``prepare`` tokenized the file, padded with 0 to the batch's longest
    (with ``segment_ids`` and ``positions`` when training packs, one example a row).
    Each text is cut to ``longest`` tokens, the longest that training read: its first
    ones (a classifier's), or with ``keep_last`` its last ones (a prompt a language
    model continues). A request's cost is bounded so: one 1 MB string would otherwise
    ask a classifier for an attention of 350,000 x 350,000 positions. The string is
    cut before it is tokenized too (to ``longest`` bytes, or 16 bytes a token for a
    vocabulary), so that tokenizing it costs no more.
    """

    def __init__(
        self, tokenizer: Tokenizer, longest: int, packed: bool = False, keep_last: bool = False
    ):
        super().__init__(name="text_features")
        self.tokenizer, self.packed = tokenizer, packed
        self.longest, self.keep_last = longest, keep_last

    @property
    def limit(self) -> str:
        """What an export says of its bound, in words."""
        return f"each text cut to its {'last' if self.keep_last else 'first'} {self.longest} tokens"

    @tf.autograph.experimental.do_not_convert
    def __call__(self, stored: dict) -> dict:
        """The model's features of a batch of strings."""
        ids = self.tokenizer.tokenize(self._cut(stored["text"]))
        ids = ids[:, -self.longest :] if self.keep_last else ids[:, : self.longest]
        if self.packed:
            return packing.Packer.prediction(({"tokens": ids}, {}))[0]
        return {"tokens": ids.to_tensor()}

    def _cut(self, texts: tf.Tensor) -> tf.Tensor:
        """Each string's first (or last) bytes, at most as many as its kept tokens take."""
        most = self.longest * (1 if self.tokenizer.kind == "bytes" else 16)
        length = tf.strings.length(texts)
        start = tf.maximum(length - most, 0) if self.keep_last else tf.zeros_like(length)
        return tf.strings.substr(texts, start, tf.fill(tf.shape(length), most))


def served(
    dataset: tf.data.Dataset, data_dir: str, longest: int, keep_last: bool = False
) -> tf.data.Dataset:
    """``dataset``, marked so that an export takes strings, tokenized inside as prepared.

    ``longest``: the most tokens of a text the export keeps (``TextFeatures``).
    """
    key = os.path.abspath(data_dir)
    if key not in _TOKENIZERS:  # made once a process: its tables are captured
        metadata = shards.read_metadata(data_dir)
        kind = metadata.get("tokenizer", "bytes")
        kept = os.path.join(data_dir, KEPT.get(kind, ""))
        if kind == "sentencepiece":
            _TOKENIZERS[key] = sentencepiece(kept)
        else:
            _TOKENIZERS[key] = Tokenizer(kind, read_vocabulary(kept) if kind in KEPT else None)
    return tokenized_by(dataset, _TOKENIZERS[key], longest, keep_last)


def tokenized_by(
    dataset: tf.data.Dataset, tokenizer: Tokenizer, longest: int, keep_last: bool = False
) -> tf.data.Dataset:
    """``dataset``, marked so that an export takes strings and ``tokenizer`` tokenizes them.

    At most ``longest`` tokens of each string: its first, or with ``keep_last`` its last.
    """
    features = TextFeatures(tokenizer, longest, packing.options().active, keep_last)
    return serving.serves(
        dataset,
        features,
        STORED,
        batched=True,
        imports=("tensorflow_text",) if tokenizer.kind in ("wordpiece", "sentencepiece") else (),
    )


_TOKENIZERS: dict = {}  # by data_dir (and 'bytes'): made once a process


def bytes_tokenizer() -> Tokenizer:
    """The ``bytes`` tokenizer, made once a process: datasets and exports capture its table."""
    if "bytes" not in _TOKENIZERS:
        _TOKENIZERS["bytes"] = Tokenizer("bytes")
    return _TOKENIZERS["bytes"]
