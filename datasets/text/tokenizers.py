"""Text to token ids, in TensorFlow ops: what ``prepare`` tokenizes with, and an export too.

``bytes`` (each UTF-8 byte a token, ids 1 to 256), ``words`` (a vocabulary learned
from the file, kept as ``vocab.txt``), ``wordpiece`` (a vocabulary given, through
tensorflow-text's ``BertTokenizer``) and ``sentencepiece`` (a model given, its ids
plus one); 0 pads. One ``Tokenizer`` for preparing and serving, so that an export
cannot drift from training.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import numpy as np
import tensorflow as tf

from datasets.records import shards
from trainer import UserError

TOKENIZERS = ("bytes", "words", "wordpiece", "sentencepiece")


VOCAB, PIECES = shards.VOCABULARIES


KEPT = {"words": VOCAB, "wordpiece": VOCAB, "sentencepiece": PIECES}


PAD, UNKNOWN = 0, 1


class Tokenizer(tf.Module):
    """Text to token ids (0 pads), in TensorFlow ops.

    ``bytes``; ``words`` of a vocabulary learned from the file; ``wordpiece`` of one
    given. What ``prepare`` tokenizes the file with, and what an export takes strings
    through (``features_of``): one function, so serving cannot drift from training.
    """

    def __init__(self, kind: str, vocabulary: list[str] | bytes | None = None):
        if kind not in TOKENIZERS:
            raise UserError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {kind!r}")
        super().__init__(name=f"{kind}_tokenizer")
        self.kind, self.vocabulary = kind, vocabulary  # a SentencePiece model's bytes
        with tf.init_scope():  # made once, eagerly: datasets and exports capture it
            if kind == "wordpiece":
                self._wordpiece = _wordpiece(vocabulary)
            elif kind == "sentencepiece":
                self._pieces = _text_ops(kind).SentencepieceTokenizer(model=vocabulary)
            else:
                keys = [bytes([b]) for b in range(256)] if kind == "bytes" else vocabulary
                ids = tf.range(1 if kind == "bytes" else 0, len(keys) + 1, dtype=tf.int64)
                self._table = tf.lookup.StaticHashTable(
                    tf.lookup.KeyValueTensorInitializer(keys, ids[: len(keys)]), UNKNOWN
                )

    @classmethod
    def learned(
        cls, kind: str, texts: Iterable[list[str]], vocab_size: int, vocab: str | None = None
    ) -> Tokenizer:
        """A tokenizer of ``kind``, its vocabulary learned or read.

        ``words`` learns the ``vocab_size - 3`` most frequent ones of ``texts`` (lists
        of documents, read one list at a time): ``vocab_size`` counts every id, and
        padding, unknown and a document's end are the other three. ``wordpiece`` reads
        the vocabulary file ``vocab``.
        """
        if kind == "wordpiece":
            return cls(kind, read_vocabulary(vocab))
        if kind == "sentencepiece":
            return sentencepiece(vocab)
        if kind != "words":
            return cls(kind)
        if vocab_size < 4:
            raise UserError(
                f"--vocab_size must be at least 4 (padding, unknown, a word, a document's end), "
                f"got {vocab_size}"
            )
        counts = collections.Counter()
        for chunk in texts:
            found = split_words(tf.constant(chunk)).flat_values.numpy()
            counts.update(word.decode() for word in found)
        frequent = sorted(counts, key=lambda w: (-counts[w], w))[: vocab_size - 3]
        return cls(kind, ["[PAD]", "[UNK]", *frequent])

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer gives, padding included."""
        if self.kind == "sentencepiece":
            return int(self._pieces.vocab_size()) + 1
        return 257 if self.kind == "bytes" else len(self.vocabulary)

    @tf.autograph.experimental.do_not_convert
    def tokenize(self, texts: tf.Tensor) -> tf.RaggedTensor:
        """The token ids (int64) of a batch of strings, ``[batch, (length)]``."""
        if self.kind == "wordpiece":
            return self._wordpiece.tokenize(texts).merge_dims(1, -1)
        if self.kind == "sentencepiece":  # 0 pads: the model's ids shifted by one
            return tf.cast(self._pieces.tokenize(texts), tf.int64) + 1
        pieces = tf.strings.bytes_split(texts) if self.kind == "bytes" else split_words(texts)
        return tf.ragged.map_flat_values(self._table.lookup, pieces)

    def ids(self, text: str) -> list[int]:
        """The token ids of ``text``."""
        return self.all_ids([text])[0].tolist()

    def all_ids(self, texts: list[str]) -> list[np.ndarray]:
        """The token ids (int64) of each of ``texts``, a thousand at a time.

        Bytes are their own ids plus one, in numpy: a document of 10 MB takes 90 MB
        to tokenize, not the 400 MB of a string tensor of its bytes and a list of ints.
        """
        if self.kind == "bytes":
            return [np.frombuffer(t.encode(), np.uint8).astype(np.int64) + 1 for t in texts]
        found = []
        for start in range(0, len(texts), 1000):
            ragged = self.tokenize(tf.constant(texts[start : start + 1000]))
            found += np.split(ragged.flat_values.numpy(), ragged.row_splits.numpy()[1:-1])
        return found


@tf.autograph.experimental.do_not_convert
def split_words(texts: tf.Tensor) -> tf.RaggedTensor:
    r"""The words of a batch of strings, lower-cased.

    Runs of letters, digits and ``_``, and single other characters that are not
    spaces (``SPACES``): Python's ``re.findall(r"\w+|[^\w\s]")``, in RE2.
    """
    lowered = tf.strings.lower(texts, encoding="utf-8")
    spaced = tf.strings.regex_replace(lowered, rf"([\pL\pN_]+|[^\pL\pN_{SPACES}])", r" \1 ")
    return tf.strings.split(tf.strings.regex_replace(spaced, rf"[{SPACES}]+", " "))


# What Python's str.isspace() calls a space, in RE2: \s and \pZ miss the vertical tab,
# the separators \x1c-\x1f and NEL, which would be words that a vocab.txt, one per
# line as Python reads it, cannot hold.
SPACES = r"\s\pZ\x{0b}\x{1c}-\x{1f}\x{85}"


def read_vocabulary(path: str | None) -> list[str]:
    """A WordPiece vocabulary file's tokens, one per line, ``[PAD]`` first.

    Raises:
      UserError: in one line, for a file that is missing, empty, not UTF-8, or not a
        vocabulary (an empty or repeated line, no ``[PAD]`` first or no ``[UNK]``).
    """
    if not path:
        raise UserError(
            "--tokenizer wordpiece needs --vocab FILE: its vocabulary, one token a line"
        )
    try:
        with open(path, encoding="utf-8") as f:
            tokens = f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"--vocab {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"--vocab {path} is a folder: name the vocabulary file in it") from None
    except UnicodeDecodeError:
        raise UserError(f"--vocab {path}: not UTF-8 text, so not a vocabulary") from None
    seen: dict[str, int] = {}
    for number, token in enumerate(tokens, 1):
        if not token.strip() or token != token.strip():
            raise UserError(f"--vocab {path}:{number}: an empty or spaced token; one per line")
        if token in seen:
            raise UserError(f"--vocab {path}:{number}: {token!r} again (line {seen[token]})")
        seen[token] = number
    if not tokens or tokens[0] != "[PAD]" or "[UNK]" not in seen:
        raise UserError(
            f"--vocab {path}: a WordPiece vocabulary has [PAD] on its first line (id 0 pads) "
            "and an [UNK]"
        )
    return tokens


def sentencepiece(path: str | None) -> Tokenizer:
    """A SentencePiece model file's tokenizer; one line for a file that is not one."""
    if not path:
        raise UserError("--tokenizer sentencepiece needs --vocab FILE: a SentencePiece .model")
    try:
        with open(path, "rb") as f:
            model = f.read()
    except FileNotFoundError:
        raise UserError(f"--vocab {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"--vocab {path} is a folder: name the .model file in it") from None
    try:
        tokenizer = Tokenizer("sentencepiece", model)
        tokenizer.tokenize(tf.constant(["a"]))
    except (tf.errors.InvalidArgumentError, tf.errors.InternalError):
        raise UserError(
            f"--vocab {path}: not a SentencePiece model (the .model file its trainer writes, "
            "not its .vocab)"
        ) from None
    return tokenizer


def _text_ops(kind: str):
    """The ``tensorflow_text`` module, or one line on what to install."""
    try:
        import tensorflow_text
    except ImportError:
        raise UserError(
            f"--tokenizer {kind} needs tensorflow-text: pip install -e '.[text]'"
        ) from None
    return tensorflow_text


def _wordpiece(vocabulary: list[str]):
    """tensorflow-text's BertTokenizer over ``vocabulary`` (lower-cased), ids as int64."""
    tensorflow_text = _text_ops("wordpiece")
    table = tf.lookup.StaticVocabularyTable(
        tf.lookup.KeyValueTensorInitializer(vocabulary, tf.range(len(vocabulary), dtype=tf.int64)),
        num_oov_buckets=1,
    )
    return tensorflow_text.BertTokenizer(
        table, lower_case=True, token_out_type=tf.int64, unknown_token="[UNK]"
    )
