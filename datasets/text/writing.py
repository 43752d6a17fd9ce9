"""A text file read as a stream, checked whole, then written a document at a time.

``prepare --text`` reads the file twice (three times to learn a vocabulary of words):
once to check every row and count the documents and classes (``survey``), then in
chunks of a thousand documents, tokenized and written as they come
(``SplitWriter``): each split's shards with their offsets indexed, its documents'
lengths and its token stream. Memory holds a chunk, the vocabulary, the classes, and
12 bytes a document (its offset and length): not the text, so a corpus larger than
memory prepares as a small one does.
"""

from __future__ import annotations

import array
import csv
import dataclasses
import fractions
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from datasets.records import indexed, shards
from datasets.tables import arrow, parquet
from trainer import UserError

CHUNK = 1000  # documents tokenized at once
LENGTHS = "-lengths.npy"  # beside the shards: each document's length, by row
STREAM = "-tokens.bin"  # and the split's documents end to end, for a language model's windows


@dataclasses.dataclass(frozen=True)
class Survey:
    """What one checked pass over the file found: its documents and class names."""

    path: str
    count: int
    classes: list[str]  # in order (numbers by value, then names); empty: unlabelled


def survey(path: str, text_field: str, label_field: str, named: bool = False) -> Survey:
    """Counts the file's documents and classes, checking every row.

    ``named``: the label field was named by the user, so rows must have it.

    Raises:
      UserError: naming the file and row of an empty document, a row without the
        text field, a label that some rows have and this one lacks, or (``named``) a
        label field that no row has.
    """
    _check_readable_twice(path)
    count, classes, unlabelled, empty = 0, set(), None, None
    for number, text, label in rows(path, text_field, label_field):
        count += 1
        if label is None:
            unlabelled = unlabelled or number
        else:
            classes.add(label)
        if not text.strip():
            empty = empty or number
    if not count:
        raise UserError(f"--text {path}: the file holds no documents")
    if named and not classes:
        kind = kind_of(path)
        if kind == "lines":
            raise UserError(
                f"--label_field {label_field}: {path} is plain text, one document a line, "
                "with no fields: drop --label_field, or give JSON lines or CSV"
            )
        raise UserError(
            f"--label_field {label_field}: no row of {path} has it (row 1 has "
            f"{', '.join(map(repr, _fields_of_first(path)))}): name the labels' field"
        )
    if classes and unlabelled:
        raise UserError(
            f"{path}:{unlabelled}: no {label_field!r} where other rows have one: give every "
            "row a label, or none"
        )
    if empty:
        raise UserError(f"{path}:{empty}: the document is empty: remove the row, or give it text")
    return Survey(path, count, sorted(classes, key=_class_order))


def chunks(path: str, text_field: str, label_field: str) -> Iterator[tuple[list, list]]:
    """``(texts, labels)`` of the file's documents, ``CHUNK`` at a time, in order."""
    texts, labels = [], []
    for _, text, label in rows(path, text_field, label_field):
        texts.append(text)
        labels.append(label)
        if len(texts) == CHUNK:
            yield texts, labels
            texts, labels = [], []
    if texts:
        yield texts, labels


def kind_of(path: str) -> str:
    """'jsonl', 'csv', 'table' or 'lines', by the file's extension in any case.

    'table': Parquet, or a folder written by datasets' save_to_disk.
    """
    lowered = path.lower()
    if lowered.endswith((".jsonl", ".json")):
        return "jsonl"
    if lowered.endswith(parquet.SUFFIXES) or os.path.isfile(os.path.join(path, arrow.STATE)):
        return "table"
    return "csv" if lowered.endswith(".csv") else "lines"


def rows(path: str, text_field: str, label_field: str):
    """``(row number, text, label or None)`` of each row, by the file's kind."""
    if kind_of(path) == "table":
        yield from _table_rows(path, text_field, label_field)
        return
    try:
        with open(path, "rb") as f:
            yield from _rows(_decoded(f, path), path, text_field, label_field)
    except FileNotFoundError:
        raise UserError(f"--text {path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"--text {path} is a folder: name the file of documents") from None
    except PermissionError:
        raise UserError(f"--text {path}: not readable (permission denied)") from None


def _check_readable_twice(path: str) -> None:
    """Refuses a pipe or stdin: the file is read twice, to check it and then to write."""
    special = os.path.exists(path) and not (os.path.isdir(path) or os.path.isfile(path))
    if path == "-" or special:
        raise UserError(
            f"--text {path} is not a regular file (a pipe or stdin?): prepare reads the file "
            "twice, to check every row and then to write; save it to a file first"
        )


def _table_rows(path: str, text_field: str, label_field: str):
    """A Parquet file's or save_to_disk folder's rows, its text column checked first.

    A file cut short, a missing column, one of another type, nulls: one line each.
    """
    labelled = label_field in _table(path, {text_field: "text"}).schema.names
    columns = [text_field] + [label_field] * labelled
    number = 0
    for batch in _batches(path, columns):
        texts = batch.column(0).to_pylist()
        labels = batch.column(1).to_pylist() if labelled else [None] * len(texts)
        for text, label in zip(texts, labels, strict=True):
            number += 1
            yield number, text, _label(label, path, number)


def _table(path: str, columns: dict):
    """The rows of a Parquet file, or of a save_to_disk folder, ``columns`` checked."""
    if os.path.isdir(path):
        return arrow.ArrowRows(arrow.data_files(path), columns)
    return parquet.ParquetRows([path], columns)


def _batches(path: str, columns: list[str]):
    """The table's ``columns``, ``CHUNK`` rows at a time.

    A row group that fails to decode is one line naming the file.
    """
    if os.path.isdir(path):
        for file in arrow.data_files(path):
            yield from arrow.mapped(file).select(columns).to_batches(CHUNK)
        return
    try:
        yield from pq.ParquetFile(path).iter_batches(CHUNK, columns=columns)
    except (OSError, pa.ArrowException) as error:
        raise UserError(f"{path}: a row group could not be decoded ({error})") from None


def _fields_of_first(path: str) -> list[str]:
    """The fields of the file's first row (JSON lines or CSV), for a line about them."""
    if kind_of(path) == "table":
        return _table(path, {}).schema.names
    with open(path, "rb") as f:
        for line in _decoded(f, path):
            if kind_of(path) == "csv":
                return next(csv.reader([line]), [])
            if line.strip():
                row = json.loads(line)
                return list(row) if isinstance(row, dict) else []
    return []


def _decoded(lines, path: str):
    """The file's lines as text; one that is not UTF-8 is refused, naming it and its byte.

    A byte-order mark at the start (as Windows editors write) is not text.
    """
    offset = 0
    for number, line in enumerate(lines, 1):
        try:
            yield line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            raise UserError(
                f"--text {path}:{number}: not UTF-8 text ({error.reason} at byte "
                f"{offset + error.start:,} of the file)"
            ) from None
        offset += len(line)


def _rows(lines, path: str, text_field: str, label_field: str):
    kind = kind_of(path)
    if kind == "jsonl":
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{path}:{number}: not a JSON object ({error.msg})") from None
            label = _label(row.get(label_field) if isinstance(row, dict) else None, path, number)
            yield number, _field(row, text_field, path, number), label
    elif kind == "csv":
        yield from _csv_rows(lines, path, text_field, label_field)
    else:
        for number, line in enumerate(lines, 1):
            yield number, line.rstrip("\r\n"), None  # Windows line ends too


def _csv_rows(lines, path: str, text_field: str, label_field: str):
    """A CSV file's rows after its header row; a ragged or unreadable row is one line."""
    csv.field_size_limit(2**31 - 1)  # a document may be longer than csv's 128 KB default
    reader = csv.reader(lines)
    header = next(reader, None) or []
    try:
        for row in reader:
            number = reader.line_num
            if not row:
                continue
            if len(row) != len(header):
                raise UserError(
                    f"{path}:{number}: {len(row)} fields where the header row has "
                    f"{len(header)}: quote a field that holds a comma"
                )
            fields = dict(zip(header, row, strict=True))
            label = _label(fields.get(label_field), path, number)
            yield number, _field(fields, text_field, path, number), label
    except csv.Error as error:
        raise UserError(f"{path}:{reader.line_num}: not CSV ({error})") from None


def _field(row, field: str, path: str, number: int) -> str:
    if not isinstance(row, dict) or not isinstance(row.get(field), str):
        raise UserError(
            f"{path}:{number}: no text field {field!r} (a string): name it with --text_field"
        )
    return row[field]


def _label(value, path: str, number: int) -> str | None:
    """A row's class name: a string, or a number written one way (1, 1.0 and "1" are 1)."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise UserError(
            f"{path}:{number}: the label {json.dumps(value)[:40]} is not a class: give a name "
            "or a number"
        )
    if isinstance(value, str) and not re.fullmatch(r"\s*-?\d+(\.\d*)?\s*", value):
        return value
    number_ = float(value)
    return str(int(number_)) if number_.is_integer() else repr(number_)


def _class_order(name: str):
    """Class names in order: numbers by value, then the rest by name."""
    return (0, float(name), "") if re.fullmatch(r"-?\d+(\.\d+)?", name) else (1, 0.0, name)


def write_splits(
    out_dir: str,
    documents: Iterator[tuple[list, list]],
    tokenize: Callable[[list[str]], list],
    found: Survey,
    eval_fraction: float,
    num_shards: int,
    vocab_size: int,
    end: int,
) -> dict:
    """Writes the surveyed file's ``documents`` (``chunks``) as splits; their entries.

    ``vocab_size``: the ids written, ``end`` (ending each document in the stream) too.

    ``eval_fraction`` of the documents, spread evenly (``held_out``), are the ``test``
    split, the same on every run.

    Raises:
      UserError: a document the tokenizer gives no token.
    """
    held = held_out(eval_fraction)
    tested = held.count(found.count)
    writers = {
        split: SplitWriter(out_dir, split, count, num_shards, vocab_size, end)
        for split, count in (("train", found.count - tested), ("test", tested))
        if count
    }
    classes = {name: i for i, name in enumerate(found.classes)}
    number = 0
    for texts, labels in documents:
        for ids, label in zip(tokenize(texts), labels, strict=True):
            if not len(ids):
                raise UserError(f"{found.path}: document {number + 1} has no tokens: give it text")
            split = "test" if held(number) else "train"
            writers[split].add(ids, classes[label] if classes else None)
            number += 1
    return {split: writer.close() for split, writer in writers.items()}


def check_fraction(fraction) -> None:
    """Refuses an ``--eval_fraction`` that is not a share below 1."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 <= fraction < 1:
        raise UserError(
            f"--eval_fraction is the share of the documents held out, from 0 (none) to below 1, "
            f"got {fraction!r}"
        )


def held_out(fraction: float) -> Callable[[int], bool]:
    """Whether document ``n`` is held out: ``floor(n * fraction)`` of the first ``n`` are.

    Exactly the fraction, spread evenly (0.1: the 10th, 20th, ... document; 0.4: 2 of
    every 5), as a function of the document's number alone.
    """
    ratio = fractions.Fraction(fraction).limit_denominator(10**6)
    p, q = ratio.numerator, ratio.denominator

    def held(n: int) -> bool:
        return (n + 1) * p // q > n * p // q

    held.count = lambda documents: documents * p // q  # how many of so many are held out
    return held


class SplitWriter:
    """One split's shards, lengths and token stream, written a document at a time.

    Args:
      out_dir: where the files go.
      split: the split's name.
      count: its documents, dealt to ``num_shards`` shards as ``np.array_split`` deals.
      num_shards: shards to write (fewer if there are fewer documents).
      vocab_size: ids written: the stream's ids take 2 bytes, 4 past 65,536.
      end: the id that ends each document in the stream, so that a language model's
        windows, which cut the stream, see where one document ends and the next begins.
    """

    def __init__(
        self,
        out_dir: str,
        split: str,
        count: int,
        num_shards: int,
        vocab_size: int,
        end: int,
        stream: bool = True,
    ):
        self.out_dir, self.split, self.count, self.end = out_dir, split, count, end
        shard_count = min(num_shards, count)
        least, extra = divmod(count, shard_count)
        self.sizes = [least + 1] * extra + [least] * (shard_count - extra)
        self.dtype = "uint16" if vocab_size <= 2**16 else "int32"
        self.stream = None  # a language model's token stream: documents', not pairs'
        if stream:
            self.stream = open(os.path.join(out_dir, f"{split}{STREAM}"), "wb")  # noqa: SIM115
        self.lengths = array.array("i")
        self.written: list[dict] = []
        self.writer, self.offsets, self.offset = None, array.array("q"), 0
        self.digest = hashlib.sha256()  # of the records in order: what was prepared, by content

    def add(self, ids: np.ndarray, label: int | None, mask: np.ndarray | None = None) -> None:
        """Writes one document's token ids (and class id, or which tokens a loss counts)."""
        self.record(example_bytes(ids, label, mask), len(ids))
        np.asarray(ids, self.dtype).tofile(self.stream)
        np.asarray([self.end], self.dtype).tofile(self.stream)

    def record(self, data: bytes, length: int) -> None:
        """Writes one serialized example, its offset indexed and its ``length`` kept."""
        if self.writer is None or len(self.offsets) == self.sizes[len(self.written)]:
            self._next_shard()
        self.writer.write(data)
        self.digest.update(data)
        self.offsets.append(self.offset)
        self.offset += len(data) + indexed.HEADER + 4
        self.lengths.append(length)

    def _next_shard(self) -> None:
        if self.writer is not None:
            self._close_shard()
        self.path = os.path.join(
            self.out_dir, shards.shard_name(self.split, len(self.written), len(self.sizes), None)
        )
        self.writer = tf.io.TFRecordWriter(self.path)
        self.offsets, self.offset = array.array("q"), 0

    def _close_shard(self) -> None:
        self.writer.close()
        indexed.write_index(self.path, np.frombuffer(self.offsets, np.int64))
        name = os.path.basename(self.path)
        self.written.append(
            {"file": name, "count": len(self.offsets), "bytes": os.path.getsize(self.path)}
        )

    def close(self) -> dict:
        """Ends the last shard and the stream; returns the split's ``dataset.json`` entry."""
        self._close_shard()
        lengths = np.frombuffer(self.lengths, np.int32)
        np.save(os.path.join(self.out_dir, f"{self.split}{LENGTHS}"), lengths)
        entry = {
            "count": self.count,
            "shards": self.written,
            "tokens": int(lengths.sum(dtype=np.int64)),
            "longest": int(lengths.max()),
            "lengths": f"{self.split}{LENGTHS}",
            "digest": self.digest.hexdigest()[:32],
        }
        if self.stream is None:
            return entry
        self.stream.close()
        entry["stream"] = {
            "file": f"{self.split}{STREAM}",
            "dtype": self.dtype,
            "tokens": int(lengths.sum(dtype=np.int64)) + len(lengths),  # an end each
            "end": self.end,
        }
        return entry


def features_bytes(features: dict[str, np.ndarray]) -> bytes:
    """``tf.train.Example`` of int64 lists by name, serialized in numpy, keys sorted.

    As ``example_bytes`` makes a document's, for records of several sequences.
    """
    entries = (
        _map_entry(key.encode(), _int64_list(np.asarray(features[key], np.int64)))
        for key in sorted(features)
    )
    return _delimited(1, b"".join(entries))


def example_bytes(
    ids: np.ndarray, label: int | None = None, mask: np.ndarray | None = None
) -> bytes:
    """``tf.train.Example`` ``{'tokens': ids, 'label': [label], 'mask': mask}``, serialized.

    The bytes protobuf's deterministic serialization writes (its map keys sorted),
    made without a protobuf message: a document of 10 MB costs its ids and their 1-2
    bytes each, not the 200 MB of an Int64List built from a list of Python ints and
    copied into an Example.
    """
    features = _map_entry(b"tokens", _int64_list(ids))
    if mask is not None:  # keys in order: label, mask, tokens
        features = _map_entry(b"mask", _int64_list(np.asarray(mask, np.int64))) + features
    if label is not None:
        features = _map_entry(b"label", _int64_list(np.asarray([label]))) + features
    return _delimited(1, features)  # Example.features


def _int64_list(values: np.ndarray) -> bytes:
    """A ``Feature`` holding ``Int64List(value=values)``, packed."""
    return _delimited(3, _delimited(1, _varints(np.asarray(values, np.int64))))


def _map_entry(key: bytes, feature: bytes) -> bytes:
    """One entry of ``Features.feature``: the key, then its ``Feature``."""
    return _delimited(1, _delimited(1, key) + _delimited(2, feature))


def _delimited(number: int, payload: bytes) -> bytes:
    """A length-delimited field: its tag (wire type 2), its length, its bytes."""
    return _varints(np.asarray([number << 3 | 2, len(payload)], np.int64)) + payload


def _varints(values: np.ndarray) -> bytes:
    """Base-128 varints of int64 ``values`` (a negative one in 10 bytes, as protobuf).

    A million values at a time, so that the arrays it works in stay a few MB.
    """
    chunks = (
        values[start : start + VARINTS_AT_ONCE] for start in range(0, len(values), VARINTS_AT_ONCE)
    )
    return b"".join(_varints_of(chunk.astype(np.uint64)) for chunk in chunks)


VARINTS_AT_ONCE = 2**20


def _varints_of(unsigned: np.ndarray) -> bytes:
    sizes = np.ones(len(unsigned), np.int64)
    for k in range(1, 10):
        sizes += unsigned >= np.uint64(1 << (7 * k))
    out = np.empty(int(sizes.sum()), np.uint8)
    starts = np.cumsum(sizes) - sizes
    for k in range(int(sizes.max(initial=0))):
        has = sizes > k
        low = (unsigned[has] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (sizes[has] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + k] = (low | more).astype(np.uint8)
    return out.tobytes()
