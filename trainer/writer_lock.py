"""One trainer per model_dir: a lock file held for as long as training runs.

Two trainers on one ``model_dir`` would write the same ``ckpt-N`` files and two streams
of event files. ``WriterLock`` takes an exclusive ``flock`` on ``model_dir/.trainer.lock``
and writes its holder (host and PID) into it; a second trainer is refused in one line
that names the holder. The kernel drops the lock when its process dies however it
dies, so a lock left by a killed run is taken over, with a warning naming the run that
left it. Readers (evaluate, continuous_eval, predict, export) take no lock. Paths on
object stores (``gs://``) cannot be locked and are not.
"""

from __future__ import annotations

import fcntl
import os
import socket

from absl import logging

from trainer.errors import UserError

LOCK_NAME = ".trainer.lock"


class WriterLock:
    """Held while training in ``model_dir``; a context manager.

    Raises:
      UserError: another live process holds the lock.
    """

    def __init__(self, model_dir: str):
        self.path = os.path.join(model_dir, LOCK_NAME)
        self._fd: int | None = None

    def __enter__(self) -> WriterLock:
        if "://" in self.path:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read(fd) or "another process"
            os.close(fd)
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

    def __exit__(self, *exc_info) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # a clean end leaves no holder behind
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read(fd: int) -> str:
    return os.pread(fd, 256, 0).decode(errors="replace").strip()
