"""A table's rows read by index: each named column's values at a batch of rows."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import tensorflow as tf

from datasets.order import Windows
from datasets.tables import columns as kinds


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
