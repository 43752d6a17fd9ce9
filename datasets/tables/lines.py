"""JSON lines and CSV files read in place, each row by its byte offsets.

One pass over a file finds where each row starts, with numpy, a block of 16 MB at a
time: at each line break, or, in CSV, at each line break outside quotes (a quoted
field may hold line breaks; ``""`` inside quotes keeps the count even). Blank lines
are no rows. The offsets are kept beside the file, ``FILE.index``, as a shard's are
(``datasets/records/indexed.py``): the next start reads them instead. An index is
trusted when it is newer than its file and its size agrees; otherwise the file is
indexed again, and a warning says so. A file changed during training (its size or
modification time) fails the next read of it in one line, rather than give rows
read at stale offsets.

A row read is then one ``pread`` and one parse: ``json.loads`` for a JSON line, the
``csv`` module for a CSV row (its fields named by the file's header row). The
columns' types are those of each file's first ``SAMPLE`` rows, checked before the
first step (a missing column, a list where text is expected, nulls, another type
than the first file's); a row further on that breaks them fails when it is read,
naming the file, its line and its byte.

Cost: the index pass reads each file once (0.9 GB/s of JSON lines, 0.2 to 0.4 GB/s of
CSV on this project's 2-core machine, the less for the more quotes), the index holds
8 bytes a row, and a row read costs its own bytes: the order is a full shuffle.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import tensorflow as tf
from absl import logging

from datasets.records import indexed
from datasets.tables import columns as kinds
from datasets.tables.rows import Rows
from trainer import UserError

JSON_LINES, CSV = (".jsonl", ".json"), (".csv",)
SUFFIXES = JSON_LINES + CSV
SAMPLE = 100  # rows of each file whose types are the columns' types
BLOCK = 16 * 2**20  # bytes scanned at once by the index pass
BOM = b"\xef\xbb\xbf"  # a byte-order mark (Windows editors write one): not text
_UTF8 = ": write the file as UTF-8"
_ONE_OBJECT = ": a JSON lines file holds one object a line"


class LineRows(Rows):
    """The rows of JSON lines and CSV ``paths``, one source, the ``columns`` of each.

    Args:
      paths: the files, in order (``files.paths_of``); each parsed by its suffix.
      columns: the columns to read and their kinds (``columns.KINDS``).
      skipping: rows that cannot be read are to be skipped (``rows.readable``): the
        sampled rows' types are those of the rows that read, and none is refused here.
    """

    def __init__(
        self,
        paths: Sequence[str],
        columns: Mapping[str, str],
        skipping: bool = False,
        keep_index: bool = True,
    ):
        super().__init__(columns)
        self.skipping = skipping
        self.paths = list(paths)
        self.stamps = [_stamp(path) for path in self.paths]  # before the index pass
        self.records = [record_starts(path, keep_index) for path in self.paths]
        self.files = indexed.OpenFiles(self.paths)
        self.headers = [self._header(f) for f in range(len(self.paths))]
        counts = [len(r) - (h is not None) for r, h in zip(self.records, self.headers, strict=True)]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if not len(self):
            raise UserError(f"{self.paths[0]}: no rows in {len(self.paths)} file(s)")
        schemas = [self._sampled(f) for f in range(len(self.paths))]
        self.schema = schemas[0]
        for path, schema in zip(self.paths, schemas, strict=True):
            kinds.check(schema, self.columns, path)
            kinds.check_same(schema, self.schema, self.columns, path, self.paths[0])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        """The files' size: about the bytes their rows take."""
        return sum(size for size, _ in self.stamps)

    def _read(self, rows: np.ndarray) -> tuple[list[np.ndarray], str]:
        file_of = np.searchsorted(self.starts, rows, side="right") - 1
        values = {name: kinds.empty(len(rows), kind) for name, kind in self.columns.items()}
        for file in np.unique(file_of).tolist():
            if _stamp(self.paths[file]) != self.stamps[file]:
                return list(values.values()), _changed(self.paths[file], self.stamps[file])
        for at, (row, file) in enumerate(zip(rows.tolist(), file_of.tolist(), strict=True)):
            fields, problem = self._row(file, row - int(self.starts[file]))
            for name, kind in self.columns.items():
                if problem:
                    break
                value, problem = _value(fields, name, kind)
                values[name][at] = value if not problem else values[name][at]
            if problem:
                return list(values.values()), self._where(file, row) + problem
        return list(values.values()), ""

    def _row(self, file: int, row: int) -> tuple[dict, str]:
        """Row ``row`` of file ``file`` as ``{column: value}``, or what is wrong with it."""
        header = self.headers[file]
        data = self._record(file, row + (header is not None))
        if header is None:
            return _json_row(data)
        fields, problem = _csv_fields(data)
        if not problem and len(fields) != len(header):
            problem = (
                f"{len(fields)} fields where the header row has {len(header)}: quote a field "
                "that holds a comma"
            )
        return dict(zip(header, fields, strict=False)), problem  # ragged: said

    def _record(self, file: int, record: int) -> bytes:
        starts = self.records[file]
        stop = starts[record + 1] if record + 1 < len(starts) else self.stamps[file][0]
        return self.files.pread(file, int(stop - starts[record]), int(starts[record]))

    def _header(self, file: int) -> list[str] | None:
        """A CSV file's column names (its first row), or None for JSON lines."""
        path = self.paths[file]
        if not path.lower().endswith(CSV):
            return None
        blank = not len(self.records[file])  # blank lines alone
        fields, problem = ([], "") if blank else _csv_fields(self._record(file, 0))
        if problem or not fields:
            raise UserError(f"{path}:1: no header row of column names ({problem or 'empty'})")
        return fields

    def _sampled(self, file: int) -> pa.Schema:
        """The columns' types in the file's first ``SAMPLE`` rows; their nulls refused."""
        count = int(self.starts[file + 1] - self.starts[file])
        rows = []
        for row in range(min(SAMPLE, count)):
            fields, problem = self._row(file, row)
            if problem and not self.skipping:
                raise UserError(self._where(file, int(self.starts[file]) + row) + problem)
            rows += [] if problem else [fields]
        names = list(dict.fromkeys(name for fields in rows for name in fields))
        csv_file = self.headers[file] is not None
        types = [_type([fields.get(name) for fields in rows], csv_file) for name in names]
        for name in self.columns:
            nulls = sum(fields.get(name) is None for fields in rows)
            if name in names and not self.skipping:  # else the rows are skipped
                kinds.check_no_nulls(nulls, name, f"{self.paths[file]} (first {len(rows)} rows)")
        return pa.schema(list(zip(names, types, strict=True)))

    def _where(self, file: int, row: int) -> str:
        """``PATH:LINE (byte B): `` of a row, its line counted now (a failure's cost only)."""
        record = row - int(self.starts[file]) + (self.headers[file] is not None)
        offset = int(self.records[file][record])
        return f"{self.paths[file]}:{_line_at(self.paths[file], offset)} (byte {offset:,}): "


def record_starts(path: str, keep_index: bool = True) -> np.ndarray:
    """The byte offset of each row (a CSV's header row first), from the index beside it.

    A file without a sound index is indexed by one pass, and the index saved beside
    it when its folder is writable (else made again at each start) and
    ``keep_index``: a command that reads the file once (``prepare --chat``) leaves
    the user's folder as it was. Offsets are kept once a process for each file as it
    is (its size and modification time).
    """
    key = (os.path.abspath(path), _stamp(path))
    if key not in _INDEXED:
        index = path + indexed.INDEX_SUFFIX
        starts = indexed.saved_offsets(path, index)
        if starts is None and keep_index:
            logging.info("Indexing the rows of %s (once)", path)
            starts = _scan(path, quoted=path.lower().endswith(CSV))
            _save_index(path, starts)
        elif starts is None:  # read once, by a command that leaves the folder alone
            starts = _scan(path, quoted=path.lower().endswith(CSV))
        _INDEXED[key] = starts
    return _INDEXED[key]


_INDEXED: dict = {}


def _save_index(path: str, starts: np.ndarray) -> None:
    """Keeps a file's row offsets beside it, if its folder can be written to."""
    try:
        indexed.write_index(path, starts)
    except (OSError, tf.errors.OpError):
        logging.info("Could not save the index of %s; it is made at each start", path)


def _scan(path: str, quoted: bool) -> np.ndarray:
    r"""Where each row of the file starts: after each line break (outside quotes).

    One read of the file: a byte-order mark at its start is skipped, and a blank line
    is no row, nor a lone ``\r`` (a blank Windows line).
    """
    breaks, after_cr, position, inside, last = [], [], 0, 0, 0
    with open(path, "rb") as f:
        first = len(BOM) if f.read(len(BOM)) == BOM else 0
        f.seek(0)
        while block := f.read(BLOCK):
            data = np.frombuffer(block, np.uint8)
            found = np.flatnonzero(data == ord("\n"))
            if quoted:  # a break after an even count of quotes, all told, ends a row
                quotes = np.flatnonzero(data == ord('"'))
                found = found[(np.searchsorted(quotes, found) + inside) % 2 == 0]
                inside = (inside + len(quotes)) % 2
            before = np.where(found > 0, data[found - 1], last)  # the byte before each break
            breaks.append(found + position)
            after_cr.append(before == ord("\r"))
            position, last = position + len(data), int(data[-1])
    ends = np.concatenate([*breaks, [position]]).astype(np.int64)
    starts = np.concatenate([[first], ends[:-1] + 1])
    lone_cr = np.concatenate([*after_cr, [last == ord("\r")]]) & (ends - starts == 1)
    return starts[(ends - starts > 0) & ~lone_cr]


def _json_row(data: bytes) -> tuple[dict, str]:
    try:
        row = json.loads(_text(data))
    except UnicodeDecodeError as error:
        return {}, f"not UTF-8 text ({error.reason} at byte {error.start} of the line)" + _UTF8
    except json.JSONDecodeError as error:
        return {}, f"not JSON ({error.msg} at column {error.colno}){_ONE_OBJECT}"
    if not isinstance(row, dict):
        return {}, f"a JSON {type(row).__name__}, not an object of columns{_ONE_OBJECT}"
    return row, ""


def _csv_fields(data: bytes) -> tuple[list[str], str]:
    csv.field_size_limit(2**31 - 1)  # a document may be longer than csv's 128 KB default
    try:
        return next(csv.reader([_text(data)]), []), ""
    except UnicodeDecodeError as error:
        return [], f"not UTF-8 text ({error.reason} at byte {error.start} of the row)" + _UTF8
    except csv.Error as error:
        return [], f"not CSV ({error}): quote a field that holds a quote or a line break"


def _text(data: bytes) -> str:
    return data.decode("utf-8").rstrip("\r\n")


def _value(fields: dict, name: str, kind: str):
    """A row's value of column ``name`` as its tensor holds it, and what is wrong."""
    value = fields.get(name)
    if value is None:
        said = "null" if name in fields else "missing"
        return None, f"column {name!r} is {said}: give every row a value, or drop the row"
    if isinstance(value, str) and kind != "text":
        try:  # a CSV field: its text
            value = int(value) if kind == "integer" else float(value)
        except ValueError:
            pass
    if kind == "text" and isinstance(value, str):
        return value.encode(), ""
    if kind == "messages" and _is_chat(value):
        return kinds.messages_json(value), ""
    if kind == "integer" and isinstance(value, int) and not isinstance(value, bool):
        return value, ""
    if kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return value, ""
    return None, (
        f"column {name!r} holds {str(value)[:40]!r}, not {kinds.KINDS[kind][1]}: fix the row, "
        "or give the column's kind"
    )


def _is_chat(value) -> bool:
    """A list of objects, each with a string role and content."""
    turns = isinstance(value, list) and all(isinstance(turn, dict) for turn in value)
    return turns and all(
        isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str) for turn in value
    )


def _type(values: list, csv_file: bool) -> pa.DataType:
    """The Arrow type of a column's sampled values; a CSV field's, from its text."""
    if csv_file:
        for parse, found in ((int, pa.int64()), (float, pa.float64())):
            try:
                [parse(v) for v in values if v is not None]
                return found
            except ValueError:
                continue
        return pa.string()
    try:
        return pa.infer_type(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.string() if any(isinstance(v, str) for v in values) else pa.null()


def _stamp(path: str) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def _changed(path: str, stamp: tuple[int, int]) -> str:
    size, _ = _stamp(path)
    return (
        f"{path} changed since it was indexed ({stamp[0]:,} bytes then, {size:,} now): its "
        "rows' offsets are stale; restart the run to index it again, or leave the file alone "
        "while training reads it"
    )


def _line_at(path: str, offset: int) -> int:
    """The line (from 1) that byte ``offset`` of the file lies on."""
    lines, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(BLOCK, offset - done))
            if not block:
                break
            lines, done = lines + block.count(b"\n"), done + len(block)
    return lines
