"""A folder written by Hugging Face ``datasets``' ``save_to_disk``, memory-mapped.

Such a folder holds ``state.json`` (its ``_data_files``, in order), ``dataset_info.json``
and the files ``data-0000k-of-0000n.arrow``, each an Arrow IPC stream; a
``DatasetDict``'s folder holds one such folder per split and ``dataset_dict.json``.
They are read here with pyarrow alone (``datasets`` is not needed, and this project's
own ``datasets`` package would shadow it): each file memory-mapped, so a row read by
index costs its own bytes, no decoding, and the order is a full shuffle.

Cost: opening maps the files (no copy); memory holds the pages the reads touched,
which the operating system may drop, whatever the number of rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from datasets.tables import columns as kinds
from datasets.tables.rows import Rows
from trainer import UserError

STATE, SPLITS = "state.json", "dataset_dict.json"


def folder_of(path: str, split: str | None) -> str:
    """The folder of one dataset: ``path`` itself, or its ``split`` in a DatasetDict's."""
    if os.path.isfile(os.path.join(path, SPLITS)):
        with open(os.path.join(path, SPLITS)) as f:
            splits = json.load(f).get("splits", [])
        if split not in splits:
            raise UserError(
                f"{path} is a DatasetDict of splits {', '.join(splits)}: name one (got {split!r})"
            )
        return os.path.join(path, split)
    return path


def data_files(folder: str) -> list[str]:
    """The Arrow files of a ``save_to_disk`` folder, as its ``state.json`` lists them."""
    try:
        with open(os.path.join(folder, STATE)) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise UserError(
            f"{folder}: no {STATE}: not a folder written by datasets' save_to_disk; for "
            "Parquet files, give them to parquet's input_fn"
        ) from None
    except json.JSONDecodeError as error:
        said = kinds.one_line(error)
        raise UserError(f"{folder}/{STATE}: not JSON ({said}): save the dataset again") from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    listed = isinstance(files, list) and all(isinstance(f, dict) and "filename" in f for f in files)
    if not listed:
        raise UserError(
            f"{folder}/{STATE} lists no _data_files: written by a version of datasets whose "
            "layout this reader does not know (it reads that of datasets 2 to 4); save it "
            "with such a version, or write Parquet (Dataset.to_parquet)"
        )
    return [os.path.join(folder, f["filename"]) for f in files]


class ArrowRows(Rows):
    """The rows of a ``save_to_disk`` folder's Arrow files, memory-mapped, one source."""

    def __init__(self, paths: list[str], columns: Mapping[str, str]):
        super().__init__(columns)
        self.paths = paths
        tables = [mapped(path) for path in paths]
        for path, table in zip(paths, tables, strict=True):
            kinds.check(table.schema, self.columns, path)
            kinds.check_same(table.schema, tables[0].schema, self.columns, path, paths[0])
            for name in self.columns:
                kinds.check_no_nulls(table.column(name).null_count, name, path)
        self.schema, self.count = tables[0].schema, sum(t.num_rows for t in tables)
        self.table = pa.concat_tables([t.select(list(self.columns)) for t in tables])
        if not self.count:
            raise UserError(f"{os.path.dirname(paths[0])}: the dataset has no rows")

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        """The columns' size in the files."""
        return self.table.nbytes

    def unreadable(self) -> list[tuple[np.ndarray, str]]:
        """None: mapped and checked whole when opened, every row reads."""
        return []

    def _read(self, rows: np.ndarray) -> tuple[list[np.ndarray], str]:
        taken = self.table.take(pa.array(rows))
        return [kinds.to_numpy(taken.column(n), k) for n, k in self.columns.items()], ""


def mapped(path: str) -> pa.Table:
    """The Arrow stream at ``path``, memory-mapped; one cut short is one line."""
    try:
        # Not closed: the table's buffers are the mapped pages.
        return pa.ipc.open_stream(pa.memory_map(path)).read_all()
    except FileNotFoundError:
        raise UserError(f"{path}: listed in {STATE} but missing: copy the folder whole") from None
    except (OSError, pa.ArrowException) as error:
        raise UserError(
            f"{path}: not a whole Arrow stream ({kinds.one_line(error)}); it may be cut short: "
            "copy or save the dataset again"
        ) from None
