"""Parquet files read in place, by index: one file, a folder of them, or a glob.

Parquet stores a file's rows in *row groups*, each decoded whole: a row read alone
costs its group's decoding. ``ParquetRows`` therefore gives the training order its
groups as blocks (``order.Windows``): each epoch shuffles the groups, then the rows
within each window of ``window`` consecutive groups, so that a group is decoded about
once an epoch and the order is still a pure function of ``(seed, position)``. The
groups of the current window stay decoded (two windows' worth, least recently used
out), only the columns read.

Cost: opening a source reads each file's footer (its schema, row groups and their
null counts), no rows; memory holds two windows of decoded groups of the columns
read, whatever the number of rows; a group larger than memory allows is the file's writer's
choice (``pyarrow.parquet.write_table(row_group_size=...)``, 1 to 100 MB is usual).
"""

from __future__ import annotations

import collections
import functools
import os
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from datasets import order
from datasets.tables import columns as kinds
from datasets.tables.rows import Rows
from trainer import UserError

SUFFIXES = (".parquet", ".pq")


class ParquetRows(Rows):
    """The rows of Parquet ``paths``, one source, the ``columns`` (name: kind) of each.

    Args:
      paths: the files, in order (``files.paths_of``).
      columns: the columns to read and their kinds (``columns.KINDS``).
      window: row groups per window of the training order (``order.Windows``); twice
        as many stay decoded, for the reads that straddle two windows.
    """

    def __init__(self, paths: Sequence[str], columns: Mapping[str, str], window: int = 8):
        super().__init__(columns)
        self.paths = list(paths)
        self.footers = [_footer(path) for path in self.paths]
        first = self.schema = self.footers[0].schema.to_arrow_schema()
        groups = []
        for index, (path, footer) in enumerate(zip(self.paths, self.footers, strict=True)):
            schema = footer.schema.to_arrow_schema()
            kinds.check(schema, self.columns, path)
            kinds.check_same(schema, first, self.columns, path, self.paths[0])
            _check_nulls(footer, self.columns, path)
            groups += [(index, g) for g in range(footer.num_row_groups)]
        self.groups = [(f, g) for f, g in groups if self.footers[f].row_group(g).num_rows]
        self.blocks = np.asarray(
            [self.footers[f].row_group(g).num_rows for f, g in self.groups], np.int64
        )
        self.starts = np.concatenate([[0], np.cumsum(self.blocks)]).astype(np.int64)
        if not len(self):
            raise UserError(f"{self.paths[0]}: no rows in {len(self.paths)} Parquet file(s)")
        self.windows = order.Windows(self.blocks, window)
        self.decoded = Decoded(self._decode, 2 * self.windows.window)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        """The columns' decoded size, as the footers say, with no row read."""
        names = set(self.columns)
        return sum(
            footer.row_group(g).column(c).total_uncompressed_size
            for footer in self.footers
            for g in range(footer.num_row_groups)
            for c in range(footer.num_columns)
            if footer.row_group(g).column(c).path_in_schema in names
        )

    def _read(self, rows: np.ndarray) -> tuple[list[np.ndarray], str]:
        group_of = np.searchsorted(self.starts, rows, side="right") - 1
        values = {name: kinds.empty(len(rows), kind) for name, kind in self.columns.items()}
        for group in np.unique(group_of).tolist():
            at = np.flatnonzero(group_of == group)
            table = self.decoded.get(group)
            if isinstance(table, str):
                return [v for v in values.values()], table
            taken = table.take(pa.array(rows[at] - self.starts[group]))
            for name, kind in self.columns.items():
                values[name][at] = kinds.to_numpy(taken.column(name), kind)
        return list(values.values()), ""

    def unreadable(self) -> list[tuple[np.ndarray, str]]:
        """The rows of each row group that fails to decode: each group decoded once."""
        found = []
        for group in range(len(self.groups)):
            problem = self._decode(group)
            if isinstance(problem, str):
                found.append((np.arange(self.starts[group], self.starts[group + 1]), problem))
        return found

    def _decode(self, group: int) -> pa.Table | str:
        """Row group ``group`` of the source, its columns read, or what failed, where."""
        file, index = self.groups[group]
        try:
            opened = pq.ParquetFile(self.paths[file], metadata=self.footers[file])
            return opened.read_row_group(index, columns=list(self.columns))
        except (OSError, pa.ArrowException) as error:
            said = kinds.one_line(error)
            return (
                f"{self.paths[file]}, row group {index}: input data is corrupt ({said}); "
                "re-copy the file, or write it again"
            )


class Decoded:
    """The last ``size`` row groups decoded, shared by the reads of parallel batches.

    A group is decoded outside the lock, so reads of other groups go on meanwhile.
    """

    def __init__(self, decode, size: int):
        self.decode, self.size = decode, size
        self._kept: collections.OrderedDict[int, pa.Table] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.decodes = 0  # how many groups were decoded: the benchmark's bytes per row

    def get(self, group: int) -> pa.Table | str:
        """Row group ``group``, decoded now or kept from before, or what failed."""
        with self._lock:
            if group in self._kept:
                self._kept.move_to_end(group)
                return self._kept[group]
        table = self.decode(group)
        if isinstance(table, str):
            return table
        with self._lock:
            self.decodes += 1
            self._kept[group] = table
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return table


def _footer(path: str) -> pq.FileMetaData:
    """The file's footer, read once a process for the file as it is (size, mtime)."""
    stat = os.stat(path)
    return _read_footer(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4096)  # a source's columns are read by several ParquetRows
def _read_footer(path: str, size: int, mtime_ns: int) -> pq.FileMetaData:
    try:
        return pq.read_metadata(path)
    except (OSError, pa.ArrowException) as error:
        raise UserError(
            f"{path}: not a whole Parquet file ({kinds.one_line(error)}); it may be cut short: "
            "copy or write it again"
        ) from None


def _check_nulls(footer: pq.FileMetaData, columns, path: str) -> None:
    """Refuses a column with nulls, counted by each row group's statistics."""
    for g in range(footer.num_row_groups):
        group = footer.row_group(g)
        for c in range(group.num_columns):
            chunk = group.column(c)
            stats = chunk.statistics
            if chunk.path_in_schema in columns and stats is not None and stats.has_null_count:
                where = f"{path}, row group {g}"
                kinds.check_no_nulls(stats.null_count, chunk.path_in_schema, where)
