"""The files a table source names: one file, a folder of them, or a glob."""

from __future__ import annotations

import glob
import os

from trainer import UserError


def paths_of(where: str, suffixes: tuple[str, ...], knob: str) -> list[str]:
    """The files at ``where``, sorted; refuses none, or an empty one.

    ``where``: a file, a folder (its files ending in one of ``suffixes``, in its
    subfolders too), or a glob.
    """
    if any(c in where for c in "*?["):
        paths = sorted(p for p in glob.glob(where, recursive=True) if os.path.isfile(p))
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
            f"{knob} = {where!r}: no {' or '.join(suffixes)} file there; name a file, a "
            "folder holding them, or a glob"
        )
    for path in paths:
        if os.path.getsize(path) == 0:
            raise UserError(f"{path}: the file is empty (0 bytes): remove it or write it again")
    return paths
