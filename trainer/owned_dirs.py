"""Directories a command writes, replacing only what that command wrote before.

A command that writes a directory (``prepare``'s shards, an export) is often pointed at
the wrong one: the corpus's own folder, ``data`` instead of ``data/reviews``, ``.``.
The rule every such writer follows:

* the target is new, empty, or holds the command's marker (``dataset.json``,
  ``saved_model.pb``): anything else is refused in one line that names a few of the
  files it holds, before anything is written;
* the new content is written whole under a temporary name beside the target
  (``staging``), then put in place (``put_in_place``): renamed, if the target is
  new; else moved in a file at a time, the marker last, and then the old files the
  command wrote (``Owner.files``) that the new content did not replace are removed.
  Any other file there is left as it was.

Paths go through ``tf.io.gfile``, as the exports' do: the same code writes to local
disks and to buckets.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable

import tensorflow as tf

from trainer import errors
from trainer.errors import UserError

SHOWN = 3  # of a refused folder's files, named in its line


@dataclasses.dataclass(frozen=True)
class Owner:
    """A command that writes directories, and how to tell which files of one are its own.

    Args:
      command: what the line calls it ('prepare', 'export').
      flag: the option naming the target ('--out', 'export_dir').
      marker: the file every directory it writes holds, written last.
      files: a directory it wrote -> the names of its files there (the marker too).
      unfinished: the end of the name of a file that a write it can resume leaves
        (``.progress.json``): a folder holding one is its own too.
    """

    command: str
    flag: str
    marker: str
    files: Callable[[str], set[str]]
    unfinished: str | None = None


def check(target: str, owner: Owner) -> None:
    """Refuses a ``target`` that is a file, or a folder of files ``owner`` did not write.

    Raises:
      UserError: one line naming the target, a few of its files, and the fix.
    """
    if not tf.io.gfile.exists(target):
        return
    if not tf.io.gfile.isdir(target):
        raise UserError(f"{owner.flag} {target} is a file: name a folder to write into")
    names = sorted(name.rstrip("/") for name in tf.io.gfile.listdir(target))
    if not names or owner.marker in names:
        return
    if owner.unfinished and any(name.endswith(owner.unfinished) for name in names):
        return
    shown = ", ".join(names[:SHOWN]) + (
        f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    )
    raise UserError(
        f"{owner.flag} {target} holds files {owner.command} did not write ({shown}): "
        f"name a new or empty folder; nothing was written"
    )


def staging(target: str, owner: Owner) -> str:
    """A new temporary directory beside ``target`` (never inside it), made empty.

    Raises:
      UserError: the folder it would be in cannot be written.
    """
    absolute = target if "://" in target else os.path.abspath(target)
    parent, name = os.path.split(absolute.rstrip("/"))
    path = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        tf.io.gfile.makedirs(path)
    except (OSError, tf.errors.OpError) as error:
        reason = getattr(error, "strerror", None) or errors.first_line(error).split("; ")[-1]
        raise UserError(
            f"{owner.flag} {target} cannot be written ({reason} in {parent}): "
            "choose a folder you can write to"
        ) from None
    return path


def put_in_place(new: str, target: str, owner: Owner) -> None:
    """Makes the whole directory ``new`` the content ``owner`` has at ``target``.

    A new (or empty) target is ``new`` renamed. Into a target the owner wrote before,
    each file of ``new`` is moved over its namesake, the marker last; then the files the
    owner wrote there before and did not write now are removed. Other files stay.
    """
    check(target, owner)  # again: it may have changed while ``new`` was written
    if tf.io.gfile.exists(target) and not tf.io.gfile.listdir(target):
        _remove_empty(target)
    if not tf.io.gfile.exists(target):
        tf.io.gfile.rename(new, target)
        return
    before = (
        owner.files(target) if tf.io.gfile.exists(os.path.join(target, owner.marker)) else set()
    )
    names = sorted(n.rstrip("/") for n in tf.io.gfile.listdir(new))
    for name in sorted(names, key=lambda n: n == owner.marker):
        _replace(os.path.join(new, name), os.path.join(target, name))
    for name in sorted(before - set(names)):
        _remove(os.path.join(target, name))
    _remove(new)


def discard(new: str) -> None:
    """Removes a staging directory that will not be put in place."""
    if tf.io.gfile.exists(new):
        tf.io.gfile.rmtree(new)


def _replace(source: str, destination: str) -> None:
    if tf.io.gfile.isdir(destination):
        tf.io.gfile.rmtree(destination)
    tf.io.gfile.rename(source, destination, overwrite=True)


def _remove(path: str) -> None:
    if tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
    elif tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)


def _remove_empty(path: str) -> None:
    """Removes an empty directory; one that is the working directory is kept (and filled)."""
    if "://" not in path and os.path.samefile(path, os.getcwd()):
        return
    tf.io.gfile.rmtree(path)
