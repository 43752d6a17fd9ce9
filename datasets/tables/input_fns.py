"""Tables read where they lie, by index: a text classifier's documents with no ``prepare``.

In gin::

    import datasets.tables.input_fns
    experiment.input_fn = @tables.input_fn
    tables.input_fn.train = 'data/functions/train.parquet'   # a file, a folder or a glob
    tables.input_fn.eval = 'data/functions/test.parquet'
    tables.input_fn.tokenizer = 'words'
    TextClassifier.vocab_size = @tables.vocab_size()

``train`` and ``eval`` are Parquet, JSON lines (``.jsonl``, ``.json``) or CSV files
(one, a folder of them, or a glob; one kind a source) or a folder written by Hugging
Face ``datasets``' ``save_to_disk`` (``split`` names one of a ``DatasetDict``'s).
``text`` names the column of documents and ``label`` that of their classes: whole
numbers, or class names, made class ids in sorted order of the training source's
names. Rows are read by index (``datasets/tables/parquet.py``, ``arrow.py``,
``lines.py``), held in memory when they fit ``pipeline.memory_limit_mb``, and batched
as the other input functions are (buckets, grouping, token budgets).

Tokenizers: ``bytes`` (each UTF-8 byte, ids 1 to 256) or ``words``, a vocabulary of
the ``vocab_size - 3`` most frequent words learned from the training source's text
column, once a process: one pass over that column (the cost ``prepare`` pays once, paid
here at each start). An export takes strings and tokenizes them the same way.
"""

from __future__ import annotations

import dataclasses
import os

import gin
import numpy as np
import pyarrow as pa
import tensorflow as tf

from datasets import lengths, packing, pipeline
from datasets.tables import arrow, files, lines, parquet
from datasets.tables.rows import Rows, Subset, readable
from datasets.text.serving import tokenized_by
from datasets.text.tokenizers import Tokenizer
from datasets.text.writing import check_fraction, held_out
from trainer import InputParams, Mode, UserError

_MADE: dict = {}  # by (source, columns, ...): read and learned once a process


def rows_of(
    where: str, columns: dict, split: str | None = None, window: int = 8, skipping: bool = False
):
    """The rows of ``where`` (Parquet, JSON lines, CSV, a ``save_to_disk`` folder), by index.

    ``skipping``: rows that cannot be read are to be skipped, so none is refused yet.
    """
    key = ("rows", os.path.abspath(where), tuple(columns.items()), split, window, skipping)
    if key not in _MADE:
        if os.path.isdir(where) and _saved_by_datasets(where):
            folder = arrow.folder_of(where, split)
            _MADE[key] = arrow.ArrowRows(arrow.data_files(folder), columns)
        else:
            paths = files.paths_of(where, SUFFIXES, "tables.input_fn's source")
            _MADE[key] = _rows(where, paths, columns, window, skipping)
    return _MADE[key]


SUFFIXES = parquet.SUFFIXES + lines.SUFFIXES


def _rows(where: str, paths: list[str], columns: dict, window: int, skipping: bool) -> Rows:
    """Parquet's rows, or JSON lines' and CSV's, by the files' suffixes."""
    in_lines = [p.lower().endswith(lines.SUFFIXES) for p in paths]
    if all(in_lines):
        return lines.LineRows(paths, columns, skipping)
    if any(in_lines):
        raise UserError(
            f"{where} holds Parquet files and JSON lines or CSV files: one source is one "
            "kind of file; give each kind as its own source"
        )
    return parquet.ParquetRows(paths, columns, window)


@dataclasses.dataclass(frozen=True)
class Source:
    """One of ``tables.input_fn``'s sources: where its rows lie, and which columns.

    ``skip_corrupt``: leave out the rows that cannot be read (a Parquet row group that
    fails to decode, a line that is not JSON or lacks a column), found by one read of
    every row at the first use and counted in the log; without it such a row stops
    the run when it is read. What is made of a source (its rows, classes, tokenizer,
    lengths) is made once a process.
    """

    where: str
    split: str | None = None
    text: str = "text"
    label: str = "label"
    window: int = 8
    skip_corrupt: bool = False

    def rows(self, columns: dict) -> Rows:
        """The source's ``columns`` read by index; with ``skip_corrupt``, its readable rows."""
        rows = rows_of(self.where, columns, self.split, self.window, self.skip_corrupt)
        kept = self.readable()
        return rows if kept is None else Subset(rows, kept)

    def readable(self) -> np.ndarray | None:
        """The rows whose text and label read, or None when all are taken as they come."""
        if not self.skip_corrupt:
            return None
        key = ("readable", self)
        if key not in _MADE:
            columns = {self.text: "text"}
            if self.label in self.schema.names:
                columns[self.label] = "text" if _is_text(self.schema, self.label) else "integer"
            knob = f"tables.input_fn.skip_corrupt ({self.where})"
            rows = rows_of(self.where, columns, self.split, self.window, skipping=True)
            kept = readable(rows, knob)
            _MADE[key] = None if len(kept) == len(rows) else kept
        return _MADE[key]

    @property
    def schema(self) -> pa.Schema:
        """Every column of the source's first file, read or not."""
        return rows_of(self.where, {}, self.split, self.window, self.skip_corrupt).schema

    @property
    def name(self) -> str:
        """Names the source in the log: its file or folder, and its split."""
        split = f"-{self.split}" if self.split else ""
        return f"{os.path.basename(os.path.normpath(self.where))}{split}"


@gin.configurable("tables.input_fn")
def input_fn(
    mode: Mode,
    params: InputParams,
    train: str = gin.REQUIRED,
    eval: str | None = None,
    text: str = "text",
    label: str = "label",
    tokenizer: str = "bytes",
    vocab_size: int = 8000,
    longest: int = 512,
    split: str | None = None,
    eval_split: str | None = None,
    eval_fraction: float | None = None,
    window: int = 8,
    skip_corrupt: bool = False,
    weights: list[float] | None = None,
) -> tf.data.Dataset:
    """Batches of ``({'tokens': int64 [batch, length]}, {'label': int64 [batch]})``.

    ``eval_fraction``: with no ``eval``, the share of ``train``'s rows held out to
    evaluate on, spread evenly as ``prepare --eval_fraction`` holds them out (0.1: the
    10th, 20th, ... row), so that both read the same split. ``longest``: the most
    tokens of a document kept (its first). ``window``: Parquet row groups per window
    of the training order (``order.Windows``). ``skip_corrupt``: see ``Source``.

    ``train`` (and ``eval``) may be a list of sources: training draws from each by its
    share of ``weights`` (default: equal), each read by index where it lies, and
    evaluation reads them one after the other. Their classes and words are learned
    from all the training sources.
    """
    knobs = (text, label, window, skip_corrupt)
    trained, read, fraction = _sources(mode, train, eval, split, eval_split, eval_fraction, knobs)
    classes = classes_of(trained)
    if classes is not None and read != trained:
        for source in read:
            _check_known(classes_of((source,)), classes, source.where, label)
    words = tokenizer_of(trained, tokenizer, vocab_size)
    columns = {text: "text", label: "text" if classes is not None else "integer"}
    example = _example(words, text, label, classes, longest)
    return _batches(read, columns, example, words, longest, fraction, mode, params, weights, False)


@gin.configurable("tables.documents_input_fn")
def documents_input_fn(
    mode: Mode,
    params: InputParams,
    train: str | list[str] = gin.REQUIRED,
    eval: str | list[str] | None = None,
    text: str = "text",
    tokenizer: str = "bytes",
    vocab_size: int = 8000,
    longest: int = 512,
    split: str | None = None,
    eval_split: str | None = None,
    eval_fraction: float | None = None,
    window: int = 8,
    skip_corrupt: bool = False,
    weights: list[float] | None = None,
) -> tf.data.Dataset:
    """A language model's batches of whole documents, each row's text one example.

    ``({'tokens': int64 [batch, length]}, {'targets': int64 [batch, length]})``: a
    document's tokens (its first ``longest``) and the same shifted by one, the last
    target of a whole document the id that ends it (the tokenizer's ``vocab_size``;
    ``tables.documents_vocab_size`` counts it). Padded with 0 (to ``lengths.buckets``),
    or several documents in a row with ``packing.length``: a model that must not attend
    from one document to the next. The knobs are ``tables.input_fn``'s, with no label.
    """
    knobs = (text, None, window, skip_corrupt)
    trained, read, fraction = _sources(mode, train, eval, split, eval_split, eval_fraction, knobs)
    words = tokenizer_of(trained, tokenizer, vocab_size)
    example = _next_tokens(words, text, longest)
    columns = {text: "text"}
    return _batches(read, columns, example, words, longest, fraction, mode, params, weights, True)


def _sources(mode: Mode, train, eval, split, eval_split, eval_fraction, knobs):
    """``(trained, read, fraction)``: the training sources and those ``mode`` reads.

    ``fraction``: the share of the training rows held out when evaluation reads
    those, else None.
    """
    training, held = mode == Mode.TRAIN, eval is None and bool(eval_fraction)
    if not (training or held) and eval is None:
        raise UserError(
            f"tables.input_fn has no rows to {mode.value} on: give its eval, or an "
            "eval_fraction of train's rows to hold out"
        )
    trained = sources_of(train, split, *knobs)
    read = trained if training or held else sources_of(eval, eval_split, *knobs)
    return trained, read, eval_fraction if held else None


def _batches(read, columns, example, words, longest, fraction, mode, params, weights, keep_last):
    """The batches of the ``read`` sources' rows made into examples, mixed by ``weights``.

    ``fraction``: the share of each source's rows held out, to evaluate on or not.
    ``keep_last``: an export keeps a text's last ``longest`` tokens (a prompt's), not
    its first.
    """
    whole = _batched(example)
    keep = mode != Mode.TRAIN
    made = [_examples(s, columns, words, longest, fraction, keep, whole) for s in read]
    name = "+".join(source.name for source in read)
    built = pipeline.build(made, mode, params, example, weights=weights, name=name)
    return tokenized_by(built, words, longest, keep_last)


def sources_of(where, split, text, label, window, skip_corrupt) -> tuple[Source, ...]:
    """``where`` (one source, or a list of them) as ``Source``s, each its own rows."""
    listed = (where,) if isinstance(where, str) else tuple(where)
    if not listed or not all(isinstance(w, str) for w in listed):
        raise UserError(
            f"tables.input_fn's source = {where!r}: give a file, folder or glob, or a list "
            "of them to mix"
        )
    return tuple(Source(w, split, text, label, window, skip_corrupt) for w in listed)


def _examples(source: Source, columns, words, longest, fraction, keep, whole):
    """A source's examples read by index.

    All its rows, or those ``fraction`` holds out (``keep``) or leaves to train on.
    ``whole``: a batch of rows to examples, the same for every source (so they join).
    """
    rows = source.rows(columns)
    kept = _lengths(source, words, longest) if _sorted_or_packed() else None
    if fraction:
        rows = _held_out(rows, fraction, keep)
        kept = None if kept is None else kept[rows.kept]
    return pipeline.RecordExamples(rows, _as_read, source.name, kept, whole)


def _as_read(row: dict) -> dict:
    """A row as it was read: its columns' values are the example's."""
    return row


@gin.configurable("tables.vocab_size")
def vocab_size() -> int:
    """The ids of ``tables.input_fn``'s tokenizer, padding included (an embedding's rows)."""
    return _vocab_of("tables.input_fn", "label")


@gin.configurable("tables.documents_vocab_size")
def documents_vocab_size() -> int:
    """The ids of ``tables.documents_input_fn``'s tokenizer and the end of a document."""
    return _vocab_of("tables.documents_input_fn", None) + 1


def _vocab_of(configurable: str, label: str | None) -> int:
    """The ids of the tokenizer that ``configurable``'s bindings make, padding included."""
    tokenizer = _bound(f"{configurable}.tokenizer", "bytes")
    if tokenizer == "bytes":
        return 257
    trained = sources_of(
        gin.query_parameter(f"{configurable}.train"),
        _bound(f"{configurable}.split", None),
        _bound(f"{configurable}.text", "text"),
        _bound(f"{configurable}.label", label),
        _bound(f"{configurable}.window", 8),
        _bound(f"{configurable}.skip_corrupt", False),
    )
    return tokenizer_of(trained, tokenizer, _bound(f"{configurable}.vocab_size", 8000)).vocab_size


def tokenizer_of(sources: tuple[Source, ...], kind: str, vocab_size: int) -> Tokenizer:
    """The tokenizer, its words learned from the sources' text columns, once a process."""
    key = ("tokenizer", sources, kind, vocab_size)
    if key not in _MADE:
        if kind not in ("bytes", "words"):
            raise UserError(
                f"tables.input_fn.tokenizer = {kind!r}: read in place, text is tokenized by "
                "'bytes' or 'words'; for wordpiece or sentencepiece, prepare the text with "
                "python3 -m datasets.prepare --text"
            )
        texts = (chunk for s in sources for chunk in _chunks(s.rows({s.text: "text"}), s.text))
        _MADE[key] = Tokenizer.learned(kind, texts, vocab_size)
    return _MADE[key]


def classes_of(sources: tuple[Source, ...]) -> list[str] | None:
    """The class names in the sources' label columns, sorted, or None for class ids."""
    key = ("classes", sources)
    if key not in _MADE:
        _MADE[key] = None  # whole numbers already, or a column the rows' check names
        if any(_is_text(s.schema, s.label) for s in sources):
            names = set()
            for s in sources:  # a source of class ids among them is refused by its rows
                names.update(
                    name for chunk in _chunks(s.rows({s.label: "text"}), s.label) for name in chunk
                )
            _MADE[key] = sorted(names)
    return _MADE[key]


def _check_known(found: list[str], classes: list[str], where: str, label: str) -> None:
    """Refuses class names of ``where`` that the training rows do not have."""
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise UserError(
            f"{where}: column {label!r} holds {len(unknown)} class name(s) the training rows "
            f"do not have ({', '.join(map(repr, unknown[:3]))}; they have "
            f"{', '.join(map(repr, classes[:8]))}): evaluate on rows of the same classes"
        )


def _is_text(schema: pa.Schema, name: str) -> bool:
    index = schema.get_field_index(name)
    return index >= 0 and pa.types.is_string(schema.field(index).type)


def _batched(example):
    """A batch of rows' examples in one call: ``example`` takes one row or many."""
    return lambda rows: example(rows, batched=True)


def _example(words: Tokenizer, text: str, label: str, classes, longest: int):
    """``preprocess``: a row's ``({'tokens'}, {'label'})``, or a batch's (``batched``)."""
    ids = None
    if classes is not None:
        with tf.init_scope():  # made once, eagerly: datasets capture it
            numbered = tf.range(len(classes), dtype=tf.int64)
            ids = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(classes, numbered), -1
            )

    def example(row: dict, batched: bool = False):
        texts = row[text] if batched else row[text][None]
        tokens = words.tokenize(texts)[:, :longest]
        found = row[label] if ids is None else ids.lookup(row[label])
        return {"tokens": tokens if batched else tokens[0]}, {"label": found}

    return example


def _next_tokens(words: Tokenizer, text: str, longest: int):
    """``preprocess``: a row's ``({'tokens'}, {'targets'})``, or a batch's (``batched``).

    The document's ids and then the end id, at most ``longest + 1`` of them: the
    tokens are all but the last, the targets all but the first.
    """
    end = words.vocab_size

    def example(row: dict, batched: bool = False):
        texts = row[text] if batched else row[text][None]
        ids = words.tokenize(texts)
        ends = tf.RaggedTensor.from_tensor(tf.fill([ids.nrows(), 1], tf.constant(end, tf.int64)))
        both = tf.concat([ids, ends], axis=1)[:, : longest + 1]
        tokens, targets = both[:, :-1], both[:, 1:]
        if not batched:
            tokens, targets = tokens[0], targets[0]
        return {"tokens": tokens}, {"targets": targets}

    return example


def _chunks(rows, column: str, size: int = 10_000):
    """A column's values, ``size`` rows at a time, in order."""
    for start in range(0, len(rows), size):
        values, problem = rows._read(np.arange(start, min(start + size, len(rows))))
        if problem:
            raise UserError(problem)
        yield [v.decode() if isinstance(v, bytes) else v for v in values[0]]


def _sorted_or_packed() -> bool:
    """Whether batching reads the examples' lengths before their records."""
    shapes = lengths.knobs()
    return bool(shapes.group_batches or shapes.token_budget or packing.knobs().active)


def _lengths(source: Source, words: Tokenizer, longest: int) -> np.ndarray:
    """Each row's length in tokens, at most ``longest``: what batches are planned by.

    Grouping, token budgets and packing read them before the records. One pass over
    the source's text column, once a process (``words`` is kept in ``_MADE`` too, so
    its ``id`` names it for as long).
    """
    key = ("lengths", source, id(words), longest)
    if key not in _MADE:
        rows = source.rows({source.text: "text"})
        chunks = _chunks(rows, source.text)
        counted = [len(ids) for chunk in chunks for ids in words.all_ids(chunk)]
        _MADE[key] = np.minimum(np.asarray(counted, np.int64), longest)
    return _MADE[key]


def _held_out(rows: Rows, fraction: float, keep: bool) -> Subset:
    """The rows held out (``keep``) or trained on, as ``prepare --eval_fraction`` splits."""
    check_fraction(fraction)
    counted = held_out(fraction).count(np.arange(len(rows) + 1, dtype=np.int64))
    chosen = (np.diff(counted) > 0) == keep  # row n is held out when the count grows at it
    if not chosen.any():
        raise UserError(
            f"tables.input_fn.eval_fraction = {fraction} of {len(rows)} rows holds none out "
            "or keeps none: give more rows or another share"
        )
    return Subset(rows, np.flatnonzero(chosen))


def _saved_by_datasets(folder: str) -> bool:
    names = os.listdir(folder)
    return arrow.STATE in names or arrow.SPLITS in names


def _bound(name: str, default):
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default
