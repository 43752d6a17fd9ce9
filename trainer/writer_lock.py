"""One trainer per model_dir: a lock file held for as long as training runs.

Two trainers on one ``model_dir`` would write the same ``ckpt-N`` files and two streams
of event files. ``WriterLock`` takes an exclusive ``flock`` on ``model_dir/.trainer.lock``
and writes its holder (host and PID) into it; a second trainer is refused in one line
that names the holder. The kernel drops the lock when its process dies however it
dies, so a lock left by a killed run is taken over, with a warning naming the run that
left it. Readers (evaluate, continuous_eval, predict, export) take no lock. Paths on
object stores (``gs://``) cannot be locked and are not.

The lock makes ``model_dir`` if it is not there. A run that fails with nothing
written (a model or input refused as it is traced) leaves no trace: the lock file and
the directories it made are removed again, so a refused model_dir is as it was.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time

import tensorflow as tf
from absl import logging

from trainer.errors import UserError

LOCK_NAME = ".trainer.lock"


class WriterLock:
    """Held while training in ``model_dir``; a context manager.

    Raises:
      UserError: another live process holds the lock.
    """

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.path = os.path.join(model_dir, LOCK_NAME)
        self._fd: int | None = None
        self._made: list[str] = []  # what __enter__ made: the lock file, then directories

    def __enter__(self) -> WriterLock:
        if "://" in self.path:
            tf.io.gfile.makedirs(self.model_dir)
            return self
        self._made = missing_dirs(self.model_dir)
        os.makedirs(self.model_dir, exist_ok=True)
        if not os.path.exists(self.path):
            self._made.insert(0, self.path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read(fd) or "another process"
            os.close(fd)
            self._made = []
            raise UserError(
                f"{os.path.dirname(self.path)} is being trained by {holder}: one trainer "
                "per model_dir; wait for it or stop it, or train in another --model_dir"
            ) from None
        left = _read(fd)
        if left:
            logging.warning("Took over %s from %s, which is no longer running", self.path, left)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # a clean end leaves no holder behind
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        if exc_type is not None:
            self._unmake()

    def _unmake(self) -> None:
        """Removes what ``__enter__`` made, as long as nothing else was written beside it."""
        for path in self._made:
            try:
                os.rmdir(path) if os.path.isdir(path) else os.remove(path)
            except OSError:  # the run wrote something there: keep it, and its parents
                return


def missing_dirs(path: str) -> list[str]:
    """``path`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        path = parent if parent != path else ""
    return missing


def remove_unused(directories: list[str], patience: float = 0.0) -> None:
    """Removes each directory (deepest first) that holds nothing but writer locks no one holds.

    A run refused because another holds the lock may have made the directory a moment
    before the other took it: the holder's lock keeps it (removing it would let a third
    trainer in). The locks are held while the directory is removed. ``patience``:
    seconds to wait for another holder to let go (the workers of one job, which fail
    together: the one that made the directory removes it once the others are gone).
    """
    deadline = time.monotonic() + patience
    for directory in directories:
        while not _removed_if_unused(directory) and time.monotonic() < deadline:
            time.sleep(0.1)


def _removed_if_unused(directory: str) -> bool:
    """Whether ``directory`` is gone, or was kept for its files; False while a lock is held."""
    names = [os.path.join(root, n) for root, _, ns in os.walk(directory) for n in ns]
    if not os.path.isdir(directory) or any(os.path.basename(n) != LOCK_NAME for n in names):
        return True
    held: list[int] = []
    try:
        for name in names:
            held.append(os.open(name, os.O_RDWR))
            fcntl.flock(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # another trainer holds it (or removed it on the way out): look again
        return False
    else:
        shutil.rmtree(directory, ignore_errors=True)
        return True
    finally:
        for fd in held:
            os.close(fd)


def _read(fd: int) -> str:
    return os.pread(fd, 256, 0).decode(errors="replace").strip()
