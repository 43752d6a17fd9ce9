"""Tables read where they lie, by index: documents and images with no ``prepare``.

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

``tables.documents_input_fn`` reads the same sources as a language model's
documents, and ``tables.images_input_fn`` a column of encoded images; several sources
are mixed by ``weights``. What each source is, and what is made of it once a process,
is ``datasets/tables/source.py``.

Tokenizers: ``bytes`` (each UTF-8 byte, ids 1 to 256) or ``words``, a vocabulary of
the ``vocab_size - 3`` most frequent words learned from the training source's text
column, once a process: one pass over that column (the cost ``prepare`` pays once, paid
here at each start). An export takes strings and tokenizes them the same way.
"""

from __future__ import annotations

import gin
import numpy as np
import tensorflow as tf

from datasets import images, lengths, packing, pipeline
from datasets.tables.source import (
    Source,
    check_known,
    classes_of,
    held_out_rows,
    lengths_of,
    sources_of,
    tokenizer_of,
)
from datasets.text.serving import tokenized_by
from datasets.text.tokenizers import Tokenizer
from trainer import InputParams, Mode, UserError, errors


@gin.configurable("tables.input_fn")
def input_fn(
    mode: Mode,
    params: InputParams,
    train: str | list[str] = gin.REQUIRED,
    eval: str | list[str] | None = None,
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
    where = (train, eval, split, eval_split, eval_fraction)
    trained, read, fraction = _sources(mode, *where, knobs, "tables.input_fn")
    classes = _classes(trained, read, label)
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
    where = (train, eval, split, eval_split, eval_fraction)
    trained, read, fraction = _sources(mode, *where, knobs, "tables.documents_input_fn")
    words = tokenizer_of(trained, tokenizer, vocab_size)
    example = _next_tokens(words, text, longest)
    columns = {text: "text"}
    return _batches(read, columns, example, words, longest, fraction, mode, params, weights, True)


@gin.configurable("tables.images_input_fn")
def images_input_fn(
    mode: Mode,
    params: InputParams,
    train: str | list[str] = gin.REQUIRED,
    eval: str | list[str] | None = None,
    image: str = "image",
    label: str = "label",
    image_size: int = 224,
    augment: bool | str = False,
    split: str | None = None,
    eval_split: str | None = None,
    eval_fraction: float | None = None,
    window: int = 8,
    skip_corrupt: bool = False,
    weights: list[float] | None = None,
) -> tf.data.Dataset:
    """Batches of ``({'image': float32 [b, S, S, 3] in [0, 1]}, {'label': int64 [b]})``.

    ``image`` names a column of encoded images (JPEG, PNG, ...): bytes, or Hugging
    Face's ``Image`` feature (``struct<bytes, path>``), as the Hub's image datasets
    keep them in Parquet. Decoded as a prepared folder's are (``datasets/images.py``):
    the central square of side ``image_size``, or with ``augment`` 'inception' (the
    random-resized crop) or True (pad, crop, flip). The other knobs are
    ``tables.input_fn``'s; class names are made ids as there.
    """
    if augment not in images.AUGMENTS:
        raise UserError(
            f"tables.images_input_fn.augment must be one of {images.AUGMENTS}, got {augment!r}"
        )
    errors.check_count("tables.images_input_fn.image_size", image_size)
    knobs = (None, label, window, skip_corrupt, image)
    where = (train, eval, split, eval_split, eval_fraction)
    trained, read, fraction = _sources(mode, *where, knobs, "tables.images_input_fn")
    classes = _classes(trained, read, label)
    columns = {image: "bytes", label: "text" if classes is not None else "integer"}
    parse, keep = _image_example(image, label, classes), mode != Mode.TRAIN
    made = [_examples(s, columns, fraction, keep, parse) for s in read]
    name = "+".join(source.name for source in read)
    size = [image_size, image_size]
    return images.batches(made, mode, params, size, 3, augment, name, weights=weights)


def _sources(mode: Mode, train, eval, split, eval_split, eval_fraction, knobs, configurable):
    """``(trained, read, fraction)``: the training sources and those ``mode`` reads.

    ``fraction``: the share of the training rows held out when evaluation reads
    those, else None.
    """
    training, held = mode == Mode.TRAIN, eval is None and bool(eval_fraction)
    if not (training or held) and eval is None:
        raise UserError(
            f"{configurable} has no rows to {mode.value} on: give its eval, or an "
            "eval_fraction of train's rows to hold out"
        )
    trained = sources_of(train, split, *knobs)
    read = trained if training or held else sources_of(eval, eval_split, *knobs)
    return trained, read, eval_fraction if held else None


def _classes(trained, read, label: str) -> list[str] | None:
    """The training sources' class names, or None for class ids.

    The sources ``read`` (evaluation's) are refused when they hold other names.
    """
    classes = classes_of(trained)
    if classes is not None and read != trained:
        for source in read:
            check_known(classes_of((source,)), classes, source.where, label)
    return classes


def _batches(read, columns, example, words, longest, fraction, mode, params, weights, keep_last):
    """The batches of the ``read`` sources' rows made into examples, mixed by ``weights``.

    ``fraction``: the share of each source's rows held out, to evaluate on or not.
    ``keep_last``: an export keeps a text's last ``longest`` tokens (a prompt's), not
    its first.
    """
    whole, keep = _batched(example), mode != Mode.TRAIN
    made = [
        _examples(
            s, columns, fraction, keep, _as_read, whole, _lengths_if_planned(s, words, longest)
        )
        for s in read
    ]
    name = "+".join(source.name for source in read)
    built = pipeline.build(made, mode, params, example, weights=weights, name=name)
    return tokenized_by(built, words, longest, keep_last)


def _examples(source: Source, columns, fraction, keep, parse, whole=None, lengths=None):
    """A source's examples read by index.

    All its rows, or those ``fraction`` holds out (``keep``) or leaves to train on.
    ``parse``: a row to an example; ``whole``: a batch of rows to examples; both the
    same for every source (so they join). ``lengths``: each row's, or None.
    """
    rows = source.rows(columns)
    if fraction:
        rows = held_out_rows(rows, fraction, keep)
        lengths = None if lengths is None else lengths[rows.kept]
    return pipeline.RecordExamples(rows, parse, source.name, lengths, whole)


def _lengths_if_planned(source: Source, words: Tokenizer, longest: int) -> np.ndarray | None:
    """The rows' lengths when batching plans by them (grouping, budgets, packing)."""
    return lengths_of(source, words, longest) if _sorted_or_packed() else None


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


def _batched(example):
    """A batch of rows' examples in one call: ``example`` takes one row or many."""
    return lambda rows: example(rows, batched=True)


def _example(words: Tokenizer, text: str, label: str, classes, longest: int):
    """``preprocess``: a row's ``({'tokens'}, {'label'})``, or a batch's (``batched``)."""
    class_id = _class_ids(classes)

    def example(row: dict, batched: bool = False):
        texts = row[text] if batched else row[text][None]
        tokens = words.tokenize(texts)[:, :longest]
        return {"tokens": tokens if batched else tokens[0]}, {"label": class_id(row[label])}

    return example


def _class_ids(classes: list[str] | None):
    """A label's class id: its name's place in ``classes``, or the label itself (None)."""
    if classes is None:
        return lambda label: label
    with tf.init_scope():  # made once, eagerly: datasets capture it
        numbered = tf.range(len(classes), dtype=tf.int64)
        ids = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(classes, numbered), -1)
    return ids.lookup


def _image_example(image: str, label: str, classes):
    """A row's ``{'image': its encoded bytes, 'label': its class id}``."""
    class_id = _class_ids(classes)
    return lambda row: {"image": row[image], "label": class_id(row[label])}


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


def _sorted_or_packed() -> bool:
    """Whether batching reads the examples' lengths before their records."""
    shapes = lengths.knobs()
    return bool(shapes.group_batches or shapes.token_budget or packing.knobs().active)


def _bound(name: str, default):
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default
