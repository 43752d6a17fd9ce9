"""Prepared text read back: a classifier's documents and a language model's, by index.

``input_fn`` gives ``({'tokens'}, {'label'})`` of each document; ``documents_input_fn``
a language model's examples, one document each (packed several to a row with
``packing.length``). Both read the split's shards by index (in memory as a
``tf.RaggedTensor`` when they fit ``pipeline.memory_limit_mb``, else by offset) and
batch by length as ``datasets/lengths.py`` says, from the lengths prepare kept.
``vocab_size`` and ``bag_of_words_accuracy`` (a classifier's baseline) read them too.
"""

from __future__ import annotations

import io
import os

import gin
import numpy as np
import tensorflow as tf

from datasets import pipeline
from datasets.records import indexed, shards
from datasets.text.serving import served
from trainer import InputParams, Mode, UserError, errors


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
    lengths = kept_lengths(data_dir, metadata["splits"][split])
    lengths = None if lengths is None else lengths - shift
    return split_examples(data_dir, metadata, paths, split, example_of or parse, lengths), split


def split_examples(
    data_dir: str, metadata: dict, paths: list[str], split: str, example_of, lengths=None
) -> pipeline.RecordExamples:
    """A prepared split's records (its shards, ``paths``) read by index as examples.

    ``example_of`` makes an example of a record; ``lengths``: each example's, by row.
    """
    counts = [shard["count"] for shard in metadata["splits"][split]["shards"]]
    offsets = [indexed.record_offsets(p, n) for p, n in zip(paths, counts, strict=True)]
    return pipeline.RecordExamples(
        indexed.RecordSource(paths, offsets),
        example_of,
        f"{os.path.basename(os.path.normpath(data_dir))}-{split}",
        lengths=lengths,
    )


def next_of_document(record: tf.Tensor) -> dict:
    """A document's record as a language model's example: ``{'tokens', 'targets'}``."""
    tokens = parse(record)["tokens"]
    return {"tokens": tokens[:-1], "targets": tokens[1:]}


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


def next_tokens(example: dict):
    """A window's model inputs and labels: ``({'tokens'}, {'targets'})``."""
    return {"tokens": example["tokens"]}, {"targets": example["targets"]}


@gin.configurable("text.vocab_size")
def vocab_size(data_dir: str | None = None) -> int:
    """The ids of the prepared text's tokenizer, padding included (an embedding's rows).

    ``Embedding.input_dim = @text.vocab_size()`` in gin; ``data_dir`` defaults to
    ``text.input_fn.data_dir``'s binding.
    """
    data_dir = data_dir or gin.query_parameter("text.input_fn.data_dir")
    return int(shards.read_metadata(data_dir)["vocab_size"])
