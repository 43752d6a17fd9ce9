"""Text prepared once as token ids in TFRecord shards, then read by index.

    python3 -m datasets.prepare --text reviews.jsonl --out data/reviews
    python3 -m datasets.prepare --text corpus.txt --tokenizer words --vocab_size 8000
        --out data/corpus                                              (one line)

The file is JSON lines (``--text_field``, ``--label_field``), CSV with a header row
(the same fields), or plain text, one document per line. Labels, when the rows have
them, are class names (or numbers), made class ids in sorted order. Tokenizers:

* ``bytes``: each UTF-8 byte is a token, ids 1 to 256 (0 pads): no vocabulary to
  learn, nothing unknown, and a loss per token is a loss per byte;
* ``words``: a vocabulary learned from the file: its ``vocab_size - 3`` most frequent
  words (lower-cased runs of letters and digits, or single other characters), id 1
  for any other word, 0 for padding; saved as ``vocab.txt`` beside the shards;
* ``wordpiece``: a WordPiece vocabulary you give (``--vocab``, one token per line,
  ``[PAD]`` first and an ``[UNK]``, as BERT's), through tensorflow-text's
  ``BertTokenizer`` (lower-cased), which the ``text`` extra installs;
* ``sentencepiece``: a SentencePiece model you give (``--vocab spm.model``), through
  tensorflow-text's ``SentencepieceTokenizer``; ids are the model's plus one, so
  that 0 pads whatever the model's own padding is.

The vocabulary is kept beside the shards (``vocab.txt``, ``sentencepiece.model``):
an export tokenizes strings with it, in the same ops (``served``). One id more than
the tokenizer gives ends each document in the token stream (``end_of_document`` in
``dataset.json``: 257 for bytes, so ``vocab_size`` is 258): a language model's
windows see where one document ends and the next begins, and learn to end one.

A tenth of the documents (``--eval_fraction``, exactly, spread evenly: the 10th,
20th, ..., so the split is the same on every run) is held out as ``test``. Each
document is one record, its token ids a variable-length ``tokens`` feature (and
``label``), in uncompressed shards with their offsets indexed, each split's lengths
in tokens (``train-lengths.npy``, 4 bytes a document), and its documents end to end,
each followed by the end-of-document id (``train-tokens.bin``, 2 bytes a token, for a
language model's windows);
``dataset.json`` says how they were made. ``input_fn`` reads them: held in memory as
a ``tf.RaggedTensor`` when they fit (``pipeline.memory_limit_mb``), else by offset
from the files, and batched by length as ``datasets/lengths.py`` says (from the kept
lengths alone when they are on disk).

Nothing is written until the whole file has been read and checked: an empty
document, a row without the text field, or a label missing from some rows is one
line naming the file and row, and exit 2. Then it is read again and written a
thousand documents at a time (``datasets/text_writing.py``): memory does not grow
with the file (a file of 50 MB and one of 100 MB took 30 MB and 38 MB above the
imports; held whole, as before, 583 MB and 1,144 MB).
"""

from __future__ import annotations

import collections
import functools
import io
import os
from collections.abc import Iterable

import gin
import numpy as np
import tensorflow as tf
from absl import logging

from datasets import packing, pipeline, records, shards, text_writing
from datasets.sources import memory_limit
from trainer import InputParams, Mode, UserError, errors, owned_dirs, serving, whole_files

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


def prepare(
    path: str,
    out_dir: str,
    tokenizer: str = "bytes",
    vocab_size: int = 8000,
    text_field: str = "text",
    label_field: str | None = None,
    eval_fraction: float = 0.1,
    num_shards: int = 4,
    vocab: str | None = None,
) -> dict:
    """Tokenizes the file's documents and writes them as shards; returns ``dataset.json``.

    ``label_field``: the rows' field holding their class; None: 'label', if rows have it.

    ``out_dir`` must be new, empty, or prepared before (``trainer/owned_dirs.py``):
    written into a temporary directory beside it and put in place when whole, so a
    failure leaves it as it was, and only files prepare wrote are ever replaced.
    """
    owned_dirs.check(out_dir, shards.OWNER)
    text_writing.check_fraction(eval_fraction)
    errors.check_count("--shards", num_shards)
    named, label_field = label_field is not None, label_field or "label"
    found = text_writing.survey(path, text_field, label_field, named)
    documents = functools.partial(text_writing.chunks, path, text_field, label_field)
    tokens = Tokenizer.learned(tokenizer, (t for t, _ in documents()), vocab_size, vocab)
    staging = owned_dirs.staging(out_dir, shards.OWNER)
    try:
        splits = text_writing.write_splits(
            staging,
            documents(),
            tokens.all_ids,
            found,
            eval_fraction,
            num_shards,
            tokens.vocab_size + 1,
            tokens.vocab_size,  # the id after the tokenizer's ends a document
        )
        _write_description(staging, tokens, found, splits)
        owned_dirs.put_in_place(staging, out_dir, shards.OWNER)
    finally:
        owned_dirs.discard(staging)
    return shards.read_metadata(out_dir)


def _write_description(staging: str, tokens: Tokenizer, found, splits: dict) -> None:
    """Writes the kept vocabulary and ``dataset.json`` of the prepared text."""
    classes = found.classes
    metadata = {
        "kind": "text",
        "tokenizer": tokens.kind,
        "vocab_size": tokens.vocab_size + 1,  # the end of a document's id last
        "end_of_document": tokens.vocab_size,
        "num_classes": len(classes),
        "classes": classes,
        "source": os.path.basename(found.path),
        "compression": None,
        "eval_split": "test" if "test" in splits else "train",
        "splits": splits,
    }
    if tokens.kind in KEPT:
        with open(os.path.join(staging, KEPT[tokens.kind]), "wb") as f:
            kept = tokens.vocabulary
            f.write(kept if isinstance(kept, bytes) else ("\n".join(kept) + "\n").encode())
    whole_files.write_json(os.path.join(staging, shards.METADATA), metadata)


def kept_lengths(data_dir: str, entry: dict) -> np.ndarray | None:
    """The split's documents' lengths in tokens, by row, as prepare kept them (None: not kept).

    A file that does not hold one length per document of the split is refused.
    """
    if "lengths" not in entry:
        return None  # prepared before lengths were kept
    path = os.path.join(data_dir, entry["lengths"])
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            found = np.load(io.BytesIO(f.read()), allow_pickle=False)
    except Exception:  # missing, or a damaged .npy header (which fails in many ways)
        found = None
    if not (
        isinstance(found, np.ndarray)
        and found.dtype.kind == "i"
        and found.shape == (entry["count"],)
        and (found > 0).all()
    ):
        raise UserError(
            f"{path} does not hold the lengths of the {entry['count']:,} documents "
            "dataset.json lists: re-copy it with the shards, or prepare the data again"
        )
    return found.astype(np.int64)


def parse(record: tf.Tensor) -> dict:
    """One record's ``{'tokens': int64 [length], 'label': int64}`` (label -1 if none)."""
    parsed = tf.io.parse_single_example(
        record,
        {
            "tokens": tf.io.VarLenFeature(tf.int64),
            "label": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
        },
    )
    return {"tokens": tf.sparse.to_dense(parsed["tokens"]), "label": parsed["label"]}


def features_and_label(example: dict):
    """A record's model inputs: ``({'tokens': ...}, {'label': ...})``."""
    return {"tokens": example["tokens"]}, {"label": example["label"]}


@gin.configurable("text.input_fn")
def input_fn(
    mode: Mode,
    params: InputParams,
    data_dir: str = gin.REQUIRED,
    train_split: str = "train",
    eval_split: str | None = None,
) -> tf.data.Dataset:
    """Batches of ``({'tokens': int64 [batch, length]}, {'label': int64 [batch]})``.

    Padded with 0 to each batch's longest document (or to ``lengths.buckets``); TRAIN
    reads ``train_split`` by index forever, EVAL and PREDICT ``eval_split`` once.
    """
    source, split = _documents_of(data_dir, train_split if mode == Mode.TRAIN else eval_split)
    dataset = pipeline.build(source, mode, params, features_and_label, name=f"text-{split}")
    return served(dataset, data_dir, longest_prepared(data_dir))


@gin.configurable("text.documents_input_fn")
def documents_input_fn(
    mode: Mode,
    params: InputParams,
    data_dir: str = gin.REQUIRED,
    train_split: str = "train",
    eval_split: str | None = None,
) -> tf.data.Dataset:
    """A language model's batches of whole documents, each one example.

    ``({'tokens': [b, length]}, {'targets': [b, length]})``: a document's tokens but
    the last, and the same shifted by one. Padded with 0 (to ``lengths.buckets``), or
    several documents in a row with ``packing.length``: a model that must not attend
    from one document to the next, on prepared text in memory or on disk.
    """
    wanted = train_split if mode == Mode.TRAIN else eval_split
    source, split = _documents_of(data_dir, wanted, example_of=next_of_document, shift=1)
    dataset = pipeline.build(source, mode, params, next_tokens, name=f"documents-{split}")
    return served(dataset, data_dir, longest_prepared(data_dir), keep_last=True)


def longest_prepared(data_dir: str) -> int:
    """The most tokens of a prepared document (of any split): what an export keeps of a text."""
    splits = shards.read_metadata(data_dir)["splits"].values()
    return max((entry.get("longest", 0) for entry in splits), default=0) or LONGEST_UNKNOWN


LONGEST_UNKNOWN = 4096  # data prepared before the longest document was kept


def _documents_of(data_dir: str, wanted: str | None, example_of=None, shift: int = 0):
    """``(RecordExamples, split)``: a prepared split's documents, read by index.

    ``example_of`` makes an example of a record (default ``parse``); ``shift``: how
    many tokens shorter than its document it is, for the lengths kept.
    """
    metadata, paths = shards.check_shards(data_dir, wanted)
    if metadata.get("kind") != "text":
        raise UserError(
            f"{data_dir} holds images, not text: read it with tfrecord.input_fn, or prepare "
            "text with `python3 -m datasets.prepare --text FILE`"
        )
    split = wanted or shards.eval_split(metadata)
    entry = metadata["splits"][split]
    counts = [shard["count"] for shard in entry["shards"]]
    offsets = [records.record_offsets(p, n) for p, n in zip(paths, counts, strict=True)]
    lengths = kept_lengths(data_dir, entry)
    source = pipeline.RecordExamples(
        records.RecordSource(paths, offsets),
        example_of or parse,
        f"{os.path.basename(data_dir)}-{split}",
        lengths=None if lengths is None else lengths - shift,
    )
    return source, split


def next_of_document(record: tf.Tensor) -> dict:
    """A document's record as a language model's example: ``{'tokens', 'targets'}``."""
    tokens = parse(record)["tokens"]
    return {"tokens": tokens[:-1], "targets": tokens[1:]}


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


def documents(data_dir: str, split: str, labels: bool = False):
    """Every document of a prepared split, in order, as int64 token ids (and its labels)."""
    _, paths = shards.check_shards(data_dir, split)
    dataset = tf.data.TFRecordDataset(paths).map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    read = list(errors.guarded(dataset, f"reading {data_dir}"))
    found = [example["tokens"].numpy() for example in read]
    return (found, np.array([int(e["label"]) for e in read])) if labels else found


def bag_of_words_accuracy(data_dir: str) -> float:
    """A classifier's baseline: logistic regression on token counts, ``train`` to the eval split.

    Order is lost; what a model of the sequence learns beyond it is what order tells.
    """
    from scipy import sparse
    from sklearn.linear_model import LogisticRegression

    metadata = shards.read_metadata(data_dir)
    size = metadata["vocab_size"]

    def counts(split):
        docs, labels = documents(data_dir, split, labels=True)
        rows = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
        shape = (len(docs), size)
        return sparse.csr_matrix((np.ones(len(rows)), (rows, np.concatenate(docs))), shape), labels

    (x, y), (x_test, y_test) = counts("train"), counts(shards.eval_split(metadata))
    fitted = LogisticRegression(max_iter=2000).fit(x, y)
    return float((fitted.predict(x_test) == y_test).mean())


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


def next_tokens(example: dict):
    """A window's model inputs and labels: ``({'tokens'}, {'targets'})``."""
    return {"tokens": example["tokens"]}, {"targets": example["targets"]}


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


@gin.configurable("text.vocab_size")
def vocab_size(data_dir: str | None = None) -> int:
    """The ids of the prepared text's tokenizer, padding included (an embedding's rows).

    ``Embedding.input_dim = @text.vocab_size()`` in gin; ``data_dir`` defaults to
    ``text.input_fn.data_dir``'s binding.
    """
    data_dir = data_dir or gin.query_parameter("text.input_fn.data_dir")
    return int(shards.read_metadata(data_dir)["vocab_size"])
