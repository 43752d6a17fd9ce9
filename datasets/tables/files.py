"""The files a table source names: one file, a folder of them, or a glob."""

from __future__ import annotations

import glob
import os

from datasets.records.indexed import INDEX_SUFFIX
from trainer import UserError


def paths_of(where: str, suffixes: tuple[str, ...], knob: str) -> list[str]:
    """The files at ``where``, sorted; refuses none, or an empty one.

    ``where``: a file, a folder (its files ending in one of ``suffixes``, in its
    subfolders too), or a glob.
    """
    if any(c in where for c in "*?["):
        found = glob.glob(where, recursive=True)
        paths = sorted(p for p in found if os.path.isfile(p) and not p.endswith(INDEX_SUFFIX))
    elif os.path.isdir(where):
        paths = sorted(
            os.path.join(folder, name)
            for folder, _, names in os.walk(where)
            for name in names
            if name.endswith(suffixes)
        )
    elif os.path.isfile(where):
        paths = [where]
    else:
        raise UserError(f"{knob} = {where!r}: no such file or folder")
    if not paths:
        raise UserError(
            f"{knob} = {where!r}: no {_either(suffixes)} file there; name a file, a "
            "folder holding them, or a glob"
        )
    for path in paths:
        if os.path.getsize(path) == 0:
            raise UserError(f"{path}: the file is empty (0 bytes): remove it or write it again")
    return paths


def _either(suffixes: tuple[str, ...]) -> str:
    """``.a, .b or .c``."""
    return " or ".join([", ".join(suffixes[:-1]), suffixes[-1]] if len(suffixes) > 1 else suffixes)
