"""A table's rows read by index: each named column's values at a batch of rows."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa
import tensorflow as tf
from absl import logging

from datasets.order import Windows
from datasets.tables import columns as kinds
from trainer import UserError

CHECKED = 4096  # rows read at once by the check of every row (``Rows.unreadable``)
SAID = 5  # problems said one by one in the log when rows are skipped


class Rows:
    """The rows of a table source, read by index inside the graph.

    A subclass gives ``__len__`` and ``_read``, and ``windows``: the blocks of rows
    it decodes whole (Parquet's row groups), which the training order keeps together
    (``order.Windows``), or None when any row is read alone at no extra cost (Arrow,
    memory-mapped).
    """

    windows: Windows | None = None
    schema: pa.Schema  # every column of the first file, read or not

    def __init__(self, columns: Mapping[str, str]):
        self.columns = dict(columns)

    def __len__(self) -> int:
        raise NotImplementedError

    def _read(self, rows: np.ndarray) -> tuple[list[np.ndarray], str]:
        """Each column's values at ``rows``, and "" or what could not be read, where."""
        raise NotImplementedError

    @staticmethod
    def joined(parts: Sequence[Rows]) -> Joined:
        """Several sources' rows laid end to end, as one (mixed by weight in training)."""
        return Joined(parts)

    def unreadable(self) -> list[tuple[np.ndarray, str]]:
        """The rows that cannot be read, each run of them with what is wrong, where.

        One read of every row, ``CHECKED`` at a time, in order; a chunk that fails is
        read again row by row. A subclass that decodes blocks checks each block once.
        """
        found = []
        for start in range(0, len(self), CHECKED):
            rows = np.arange(start, min(start + CHECKED, len(self)))
            if self._read(rows)[1]:
                found += [(rows[i : i + 1], p) for i, p in enumerate(map(self._problem, rows)) if p]
        return found

    def _problem(self, row: int) -> str:
        return self._read(np.asarray([row]))[1]

    def _numpy(self, rows: np.ndarray):
        values, problem = self._read(rows)
        return (*values, np.asarray(problem.encode(), object))

    @tf.autograph.experimental.do_not_convert
    def read(self, rows: tf.Tensor) -> dict[str, tf.Tensor]:
        """``{column: values at rows}`` (``rows`` a vector); a failed read fails in one line.

        What ``_read`` says went wrong is the line (``trainer.errors.runtime_errors``):
        where, what, and how to fix it.
        """
        out = tf.numpy_function(
            self._numpy, [rows], (*kinds.dtypes(self.columns), tf.string), stateful=False
        )
        *values, problem = out
        check = tf.debugging.Assert(tf.equal(problem, ""), ["input data cannot be read", problem])
        with tf.control_dependencies([check]):
            values = [tf.identity(v) for v in values]
        for v in values:
            v.set_shape(rows.shape)
        return dict(zip(self.columns, values, strict=True))


class Joined(Rows):
    """The rows of several sources laid end to end, their columns alike.

    Training's order draws from each by its weight (``order.Order``) and reads any
    row of any source; its windows are those of each source, given to the order one
    by one, so the whole has none of its own.
    """

    def __init__(self, parts: Sequence[Rows]):
        super().__init__(parts[0].columns)
        other = [part.columns for part in parts if part.columns != self.columns]
        if other:
            raise UserError(
                f"sources mixed as one read the same columns: {other[0]} where the first "
                f"reads {self.columns}"
            )
        self.parts, self.schema = list(parts), parts[0].schema
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def nbytes(self) -> int:
        """The parts' bytes."""
        return sum(part.nbytes for part in self.parts)

    def _read(self, rows: np.ndarray) -> tuple[list[np.ndarray], str]:
        part_of = np.searchsorted(self.starts, rows, side="right") - 1
        values = [kinds.empty(len(rows), kind) for kind in self.columns.values()]
        for part in np.unique(part_of).tolist():
            at = np.flatnonzero(part_of == part)
            read, problem = self.parts[part]._read(rows[at] - self.starts[part])
            if problem:
                return values, problem
            for column, found in zip(values, read, strict=True):
                column[at] = found
        return values, ""


def readable(rows: Rows, knob: str) -> np.ndarray:
    """The rows of ``rows`` that can be read; those left out are counted in the log.

    Raises:
      UserError: when no row can be read.
    """
    found = rows.unreadable()
    if not found:
        return np.arange(len(rows))
    skipped = np.concatenate([at for at, _ in found])
    for at, problem in found[:SAID]:
        logging.warning("%s: skipping %d example(s): %s", knob, len(at), problem)
    logging.warning(
        "%s: skipped %d of %d examples in all (%d problem(s), the first %d said above)",
        knob,
        len(skipped),
        len(rows),
        len(found),
        min(len(found), SAID),
    )
    kept = np.setdiff1d(np.arange(len(rows)), skipped)
    if not len(kept):
        raise UserError(f"{knob}: no row can be read ({found[0][1]})")
    return kept


class Subset(Rows):
    """The rows ``kept`` (sorted) of ``rows``: a split held out of one file, in place.

    Its order keeps ``rows``' blocks: each block holds the kept rows that lie in it.
    """

    def __init__(self, rows: Rows, kept: np.ndarray):
        super().__init__(rows.columns)
        self.rows, self.kept, self.schema = rows, np.asarray(kept, np.int64), rows.schema
        if rows.windows is not None:
            block_of = np.searchsorted(rows.windows.starts, self.kept, side="right") - 1
            counts = np.bincount(block_of, minlength=len(rows.windows.sizes))
            self.windows = Windows(counts[counts > 0], rows.windows.window)

    def __len__(self) -> int:
        return len(self.kept)

    @property
    def nbytes(self) -> int:
        """About the bytes of the rows kept: their share of the whole's."""
        return int(self.rows.nbytes * len(self.kept) / max(len(self.rows), 1))

    def _read(self, rows: np.ndarray) -> tuple[list[np.ndarray], str]:
        return self.rows._read(self.kept[rows])
