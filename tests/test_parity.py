"""The same numbers as Keras: the parity matrix of tests/parity.py, cell by cell.

Every row (a model feature) under every column (how the framework trains it) ends
within the column's tolerance of Keras's own step on the same weights and batches,
or is refused in one line; a cell still known to differ is listed in ``DIFFER`` with
why, and fails the day it starts to agree (strict xfail), so that the list stays true.
"""

import logging

import pytest

from tests import parity
from tests.helpers import on_two_cpus

IN_PROCESS = [name for name, column in parity.COLUMNS.items() if column.devices == 1]
TWO_DEVICES = [name for name, column in parity.COLUMNS.items() if column.devices == 2]

# Cells that still compute something else than one device; see README's matrix.
DIFFER: dict[tuple[str, str], str] = {
    ("add_loss_sum", "microbatches_2"): "add_loss values are taken as means: said in the log",
    ("add_loss_sum", "microbatches_4"): "add_loss values are taken as means: said in the log",
    ("add_loss_sum", "towers"): "add_loss values are taken as means: said in the log",
    ("add_loss_sum", "mirrored"): "add_loss values are taken as means: said in the log",
}


def check(name: str, result: dict) -> None:
    """Asserts one cell: refused in one line, or within its tolerance."""
    if "refused" in result:
        assert "\n" not in result["refused"], result["refused"]
        return
    variable, difference = result["worst"]
    assert difference <= result["tolerance"], (
        f"{name}: {variable} is {difference:.3g} from Keras ({result['reference']}), "
        f"tolerance {result['tolerance']}"
    )


def cells(columns):
    return [
        pytest.param(
            row,
            column,
            marks=pytest.mark.xfail(strict=True, reason=DIFFER[row, column])
            if (row, column) in DIFFER
            else (),
        )
        for column in columns
        for row in parity.ROWS
    ]


@pytest.mark.parametrize("row, column", cells(IN_PROCESS))
def test_cell(row, column, tmp_path):
    check(f"{row} {column}", parity.cell(row, column, str(tmp_path)))


def test_two_device_cells():
    """Every row under towers and mirrored, in one process that split its CPU in two
    (one test, so that the suite's two workers do not both start it)."""
    found = on_two_cpus("tests.parity", "cells", ",".join(parity.ROWS), ",".join(TWO_DEVICES))
    failures, differing = [], set()
    for name, result in found.items():
        try:
            check(name, result)
        except AssertionError as error:
            failures.append(str(error).splitlines()[0])
            differing.add(tuple(name.split()))
    known = {cell for cell in DIFFER if cell[1] in TWO_DEVICES}
    assert differing == known, "\n".join(failures)


def test_a_batch_cut_in_parts_says_how_it_takes_a_layers_own_add_loss(tmp_path, caplog):
    """The cells above that differ are not silent: the log names the layer."""
    caplog.set_level(logging.INFO)
    parity.framework_run(parity.ROWS["add_loss_sum"], str(tmp_path), 1, microbatches=2)
    said = [r.getMessage() for r in caplog.records if "add losses of their own" in r.getMessage()]
    assert len(said) == 1 and "'added_loss'" in said[0] and "ops.mean" in said[0], said
