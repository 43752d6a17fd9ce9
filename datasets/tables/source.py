"""One source of the tables' input functions: where its rows lie, and what is made of them.

A ``Source`` names a file, folder or glob (Parquet, JSON lines, CSV) or a
``save_to_disk`` folder, and the columns its input function reads. Its rows are read
by index (``rows_of``: ``parquet``, ``lines`` or ``arrow``), and what is learned from
them is made once a process and kept in ``MADE``: the class names (``classes_of``),
the tokenizer's words (``tokenizer_of``), each row's length in tokens
(``lengths_of``), and with ``skip_corrupt`` the rows that can be read. A split held
out of one file is ``held_out_rows``.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pyarrow as pa

from datasets.tables import arrow, files, lines, parquet
from datasets.tables.rows import Rows, Subset, readable
from datasets.text.tokenizers import Tokenizer
from datasets.text.writing import check_fraction, held_out
from trainer import UserError

MADE: dict = {}  # by (source, columns, ...): read and learned once a process


def rows_of(
    where: str,
    columns: dict,
    split: str | None = None,
    window: int = 8,
    skipping: bool = False,
    keep_index: bool = True,
):
    """The rows of ``where`` (Parquet, JSON lines, CSV, a ``save_to_disk`` folder), by index.

    ``skipping``: rows that cannot be read are to be skipped, so none is refused yet.
    ``keep_index``: a JSON lines or CSV file's row offsets are saved beside it.
    """
    key = ("rows", os.path.abspath(where), tuple(columns.items()), split, window, skipping)
    key += (keep_index,)
    if key not in MADE:
        if os.path.isdir(where) and _saved_by_datasets(where):
            folder = arrow.folder_of(where, split)
            MADE[key] = arrow.ArrowRows(arrow.data_files(folder), columns)
        else:
            paths = files.paths_of(where, SUFFIXES, "tables.input_fn's source")
            MADE[key] = _rows(where, paths, columns, window, skipping, keep_index)
    return MADE[key]


SUFFIXES = parquet.SUFFIXES + lines.SUFFIXES


def _rows(
    where: str, paths: list[str], columns: dict, window: int, skipping: bool, keep_index: bool
) -> Rows:
    """Parquet's rows, or JSON lines' and CSV's, by the files' suffixes."""
    in_lines = [p.lower().endswith(lines.SUFFIXES) for p in paths]
    if all(in_lines):
        return lines.LineRows(paths, columns, skipping, keep_index)
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
    image: str | None = None

    def rows(self, columns: dict) -> Rows:
        """The source's ``columns`` read by index; with ``skip_corrupt``, its readable rows."""
        rows = rows_of(self.where, columns, self.split, self.window, self.skip_corrupt)
        kept = self.readable()
        return rows if kept is None else Subset(rows, kept)

    def readable(self) -> np.ndarray | None:
        """The rows whose text (or image) and label read, or None when all are taken."""
        if not self.skip_corrupt:
            return None
        key = ("readable", self)
        if key not in MADE:
            columns = {self.text: "text"} if self.text else {self.image: "bytes"}
            if self.label in self.schema.names:
                columns[self.label] = "text" if is_text(self.schema, self.label) else "integer"
            knob = f"tables.input_fn.skip_corrupt ({self.where})"
            rows = rows_of(self.where, columns, self.split, self.window, skipping=True)
            kept = readable(rows, knob)
            MADE[key] = None if len(kept) == len(rows) else kept
        return MADE[key]

    @property
    def schema(self) -> pa.Schema:
        """Every column of the source's first file, read or not."""
        return rows_of(self.where, {}, self.split, self.window, self.skip_corrupt).schema

    @property
    def name(self) -> str:
        """Names the source in the log: its file or folder, and its split."""
        split = f"-{self.split}" if self.split else ""
        return f"{os.path.basename(os.path.normpath(self.where))}{split}"


def sources_of(where, split, text, label, window, skip_corrupt, image=None) -> tuple[Source, ...]:
    """``where`` (one source, or a list of them) as ``Source``s, each its own rows."""
    listed = (where,) if isinstance(where, str) else tuple(where)
    if not listed or not all(isinstance(w, str) for w in listed):
        raise UserError(
            f"tables.input_fn's source = {where!r}: give a file, folder or glob, or a list "
            "of them to mix"
        )
    return tuple(Source(w, split, text, label, window, skip_corrupt, image) for w in listed)


def tokenizer_of(sources: tuple[Source, ...], kind: str, vocab_size: int) -> Tokenizer:
    """The tokenizer, its words learned from the sources' text columns, once a process."""
    key = ("tokenizer", sources, kind, vocab_size)
    if key not in MADE:
        if kind not in ("bytes", "words"):
            raise UserError(
                f"tables.input_fn.tokenizer = {kind!r}: read in place, text is tokenized by "
                "'bytes' or 'words'; for wordpiece or sentencepiece, prepare the text with "
                "python3 -m datasets.prepare --text"
            )
        texts = (chunk for s in sources for chunk in chunks(s.rows({s.text: "text"}), s.text))
        MADE[key] = Tokenizer.learned(kind, texts, vocab_size)
    return MADE[key]


def classes_of(sources: tuple[Source, ...]) -> list[str] | None:
    """The class names in the sources' label columns, sorted, or None for class ids."""
    key = ("classes", sources)
    if key not in MADE:
        MADE[key] = None  # whole numbers already, or a column the rows' check names
        if any(is_text(s.schema, s.label) for s in sources):
            names = set()
            for s in sources:  # a source of class ids among them is refused by its rows
                names.update(
                    name for chunk in chunks(s.rows({s.label: "text"}), s.label) for name in chunk
                )
            MADE[key] = sorted(names)
    return MADE[key]


def check_known(found: list[str], classes: list[str], where: str, label: str) -> None:
    """Refuses class names of ``where`` that the training rows do not have."""
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise UserError(
            f"{where}: column {label!r} holds {len(unknown)} class name(s) the training rows "
            f"do not have ({', '.join(map(repr, unknown[:3]))}; they have "
            f"{', '.join(map(repr, classes[:8]))}): evaluate on rows of the same classes"
        )


def is_text(schema: pa.Schema, name: str) -> bool:
    """Whether ``schema`` has a column ``name`` of strings."""
    index = schema.get_field_index(name)
    return index >= 0 and pa.types.is_string(schema.field(index).type)


def chunks(rows, column: str, size: int = 10_000):
    """A column's values, ``size`` rows at a time, in order."""
    for start in range(0, len(rows), size):
        values, problem = rows._read(np.arange(start, min(start + size, len(rows))))
        if problem:
            raise UserError(problem)
        found = values[list(rows.columns).index(column)]
        yield [v.decode() if isinstance(v, bytes) else v for v in found]


def lengths_of(source: Source, words: Tokenizer, longest: int) -> np.ndarray:
    """Each row's length in tokens, at most ``longest``: what batches are planned by.

    Grouping, token budgets and packing read them before the records. One pass over
    the source's text column, once a process (``words`` is kept in ``MADE`` too, so
    its ``id`` names it for as long).
    """
    key = ("lengths", source, id(words), longest)
    if key not in MADE:
        rows = source.rows({source.text: "text"})
        texts = chunks(rows, source.text)
        counted = [len(ids) for chunk in texts for ids in words.all_ids(chunk)]
        MADE[key] = np.minimum(np.asarray(counted, np.int64), longest)
    return MADE[key]


def held_out_rows(rows: Rows, fraction: float, keep: bool) -> Subset:
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
