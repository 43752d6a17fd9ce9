"""What a person sees of a run: a quiet start, and live progress bars.

TensorFlow's C++ runtime writes start-up chatter straight to file descriptor 2
(CUDA probing on machines without a GPU, CPU feature notes, absl's own
"log messages before InitializeLog" line), out of reach of Python's logging.
``quiet_start`` imports TensorFlow with that descriptor pointed at a
buffer, keeps the lines for the run's log, and passes through any line it does not
know to be noise, so that a real problem (a GPU driver that fails on a GPU machine)
still shows. ``ProgressBar`` is training's live bar on a terminal, ``Watched`` an
evaluation's; log lines (``logs``) are written above them. ``hushed`` keeps a
library's chatter off the console while it works.

The command line also holds back, while TensorFlow loads, the packages Keras
imports only in case they are there (``OPTIONAL_AT_IMPORT``): the command starts
about 1.5 s sooner, and they load as usual if anything imports them later.

Both stand aside when the user asks for everything: ``--verbosity`` on the command
line, or ``TF_CPP_MIN_LOG_LEVEL=0`` in the environment.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.abc
import io
import logging as pylogging
import os
import re
import signal
import sys
import tempfile
import threading
import time

# Start-up lines that carry nothing for the user on a machine without a GPU.
NOISE = re.compile(
    r"All log messages before absl::InitializeLog|cudart_stub\.cc|cpu_feature_guard\.cc|"
    r"To enable the following instructions|oneDNN custom operations|"
    r"failed call to cuInit: .*(UNKNOWN ERROR \(303\)|CUDA_ERROR_NO_DEVICE)|"
    r"Unable to register cu(DNN|FFT|BLAS) factory|computation placer already registered|"
    r"TF-TRT Warning"
)
STARTUP_LOG: list[str] = []  # what TensorFlow wrote while it was imported


def wants_everything(argv: list[str] | None = None) -> bool:
    """True when the user asked for TensorFlow's and absl's full output."""
    argv = sys.argv if argv is None else argv
    verbose = any(a == "-v" or a.startswith(("--verbosity", "-v=")) for a in argv[1:])
    return verbose or os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0"


# Packages Keras imports at start-up only if they are installed (``try: import``), for
# what the command line never asks of Keras: notebook file editing (IPython), fitting
# on DataFrames (pandas), the scikit-learn wrappers, plotting image galleries
# (matplotlib): 1.8 of the 5.5 s a command took to start. tests/test_internals.py
# checks that Keras does without them.
OPTIONAL_AT_IMPORT = ("IPython", "pandas", "sklearn", "matplotlib")


class _HeldBack(importlib.abc.MetaPathFinder):
    """Makes ``OPTIONAL_AT_IMPORT`` look absent to an ``import`` while it is installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in OPTIONAL_AT_IMPORT:
            raise ImportError(
                f"{name} is held back while TensorFlow loads (trainer/console.py); set "
                "TF_CPP_MIN_LOG_LEVEL=0 to load everything",
                name=name,
            )
        return None


@contextlib.contextmanager
def optional_packages_held_back(on: bool = True):
    """Within the block, the packages Keras imports only in case look absent."""
    held = _HeldBack()
    if on:
        sys.meta_path.insert(0, held)
    try:
        yield
    finally:
        if held in sys.meta_path:
            sys.meta_path.remove(held)


def quiet_start(command_line: bool = False) -> None:
    """Imports TensorFlow (and finds its devices) with its C++ start-up lines held back.

    The C++ log below errors stays off for the rest of the run too (unless
    ``TF_CPP_MIN_LOG_LEVEL`` is set): its warnings repeat, in C++ terms, what a
    failed step's one line already says. The ``command_line`` also holds back the
    packages Keras imports only in case (``OPTIONAL_AT_IMPORT``); Python's API does
    not, as a notebook may use them through Keras.

    The command line also ends sooner: once the exit handlers have run (checkpoints
    written, trackers told), what is left is hidden from the garbage collector
    (``gc.freeze``), whose last pass over TensorFlow's graphs took 0.7 s of a 4 s
    command. The process's memory goes back to the system as it ends all the same.
    """
    if command_line:
        atexit.register(gc.freeze)  # registered first of the run's: it runs last
    if wants_everything():
        import tensorflow  # noqa: F401

        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    with tempfile.TemporaryFile(mode="w+b") as held:
        keeper, pipe = _start_keeper(held.fileno())
        saved = os.dup(2)
        os.dup2(pipe, 2)
        os.close(pipe)
        try:
            with optional_packages_held_back(command_line):
                import tensorflow as tf

            tf.config.list_physical_devices()  # CUDA is probed here
        finally:  # an ImportError too: the keeper has said what TensorFlow wrote
            os.dup2(saved, 2)  # the pipe's last writer gone: the keeper ends
            os.close(saved)
            with contextlib.suppress(ChildProcessError):  # reaped already (SIGCHLD ignored)
                os.waitpid(keeper, 0)
            held.seek(0)
            STARTUP_LOG.extend(held.read().decode("utf-8", "replace").splitlines())


def _start_keeper(log_fd: int) -> tuple[int, int]:
    """A child process that passes on what TensorFlow writes to stderr as it loads.

    Each line goes to ``log_fd`` (trainer.log's start) and, unless it is ``NOISE``, to
    the console. A process of its own, so that a TensorFlow that aborts while loading
    (a CPU it was not built for, a broken CUDA install) still has its fatal line said.
    Returns the child's pid and the pipe's writing end.
    """
    reading, writing = os.pipe()
    pid = os.fork()  # before TensorFlow starts any thread
    if pid:
        os.close(reading)
        return pid, writing
    try:
        os.close(writing)
        for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # the loader's to answer
            signal.signal(number, signal.SIG_IGN)
        _pass_on(reading, log_fd)
    finally:
        os._exit(0)


def _pass_on(reading: int, log_fd: int) -> None:
    """Copies the pipe to ``log_fd``, and its lines that are not ``NOISE`` to stderr."""
    pending = b""
    while True:
        chunk = os.read(reading, 65536)
        os.write(log_fd, chunk)
        *lines, pending = (pending + chunk).split(b"\n") if chunk else [pending, b""]
        for line in lines:
            text = line.decode("utf-8", "replace")
            if text.strip() and not NOISE.search(text):
                os.write(2, line + b"\n")
        if not chunk:
            return


@contextlib.contextmanager
def hushed():
    """Keeps a library's chatter off the console while it does a quiet job.

    That is absl-logged INFO and warnings (TFDS logs a line per call, and warns of
    the folders its own failed lookups leave), and what it prints on stdout (TFDS's
    "Downloading and preparing" lines, though nothing downloads).
    """
    from absl import logging

    absl_logger = logging.get_absl_logger()  # its level, not absl's verbosity flag,
    level = absl_logger.level  # which a call of the Python API sets (logs.speaking)
    absl_logger.setLevel(pylogging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        absl_logger.setLevel(level)


class ProgressBar:
    """A live bar on the terminal's last line: step/max, rate, ETA and the last metrics.

    tqdm formats it (``tqdm.format_meter``); it is drawn here, one line, cut to the
    terminal's width, so that it never wraps. Bars stack: an evaluation's bar takes
    the line while it runs and gives it back to training's when it closes. Log lines
    are written above (``_AboveTheBar``): the line is erased, the message written,
    the bar drawn again. Training's bar is moved at block boundaries, from numbers
    the loop has anyway; nothing runs beside the steps.
    """

    shown: list[ProgressBar] = []  # open bars, the last one on screen
    lock = threading.RLock()  # an evaluation's bar is moved from a thread

    def __init__(self, start: int, total: int | None, description: str, unit="step", scale=False):
        self.n, self.start, self.total = start, start, total
        self.description, self.unit, self.scale = description, unit, scale
        self.postfix = ""
        self.started = time.perf_counter()
        self.format = (
            "{desc} {n_fmt}/{total_fmt} |{bar}| {rate_fmt} ETA {remaining}{postfix}"
            if total is not None
            else "{desc} {n_fmt}{unit}, {rate_fmt}{postfix}"
        )
        with self.lock:
            self.shown.append(self)
            self.draw()

    def update(self, n: int, metrics: str | None = None) -> None:
        """Moves the bar to ``n``; ``metrics`` (a formatted line) replaces the shown ones."""
        with self.lock:
            self.n = n
            if metrics is not None:
                self.postfix = metrics
            if self.shown and self.shown[-1] is self:
                self.draw()

    def close(self, leave: bool = True) -> None:
        """Takes the bar off the screen; ``leave`` keeps its last state as a line."""
        with self.lock:
            if self not in self.shown:
                return
            on_top = self.shown[-1] is self
            self.shown.remove(self)
            if on_top and leave:
                self.draw()
                _write(sys.stdout, "\n")
            elif on_top:
                _write(sys.stdout, ERASE)
            if on_top and self.shown:
                self.shown[-1].draw()

    def text(self) -> str:
        """The bar as one line of the terminal's width, less three columns."""
        from tqdm import tqdm
        from tqdm.utils import disp_trim

        # Three columns spare: the "^C" a terminal echoes when Ctrl-C is typed lands
        # after the bar, and the last column would leave the cursor waiting to wrap.
        width = _columns() - 3
        line = tqdm.format_meter(
            self.n,
            self.total,
            time.perf_counter() - self.started,
            ncols=width,
            prefix=self.description,
            unit=self.unit,
            unit_scale=self.scale,  # 96.0k/96.0k and 139k examples/s for large counts
            bar_format=self.format,
            postfix=self.postfix or None,
            initial=self.start,
        )
        return disp_trim(line, width)

    def draw(self) -> None:
        """Draws the bar over the terminal's current line."""
        _write(sys.stdout, ERASE + self.text())

    @classmethod
    def above(cls, write) -> None:
        """Calls ``write()`` with the line erased, then draws the shown bar again."""
        with cls.lock:
            if not cls.shown:
                write()
                return
            _write(sys.stdout, ERASE)
            write()
            cls.shown[-1].draw()


ERASE = "\r\x1b[K"  # to the start of the line, and clear it


def _write(stream, text: str) -> None:
    stream.write(text)
    stream.flush()


def _columns() -> int:
    """The terminal's width; 100 for a terminal that reports none (a bare pty)."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns or 100
    except (OSError, ValueError):
        return 100


class Watched:
    """A bar for work done in one compiled call (an evaluation), read from beside it.

    A thread reads ``count()`` (a variable the call adds to) every ``every`` seconds
    and moves the bar; the call itself does nothing more. When the work ends the bar
    is taken off the screen: the caller logs the result in its place.

    Args:
      count: returns how much is done so far.
      total: how much there is (None if unknown).
      description: the bar's label.
      unit: what ``count`` counts, after a space: " examples".
    """

    def __init__(self, count, total: int | None, description: str, unit: str, every=0.25):
        self.count, self.every = count, every
        large = total is None or total >= 10_000  # 96.0k/96.0k, but 0/360 rather than 0.00/360
        self.bar = ProgressBar(0, total, description, unit, scale=large)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Watched:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.bar.close(leave=False)

    def _watch(self) -> None:
        while not self.stop.wait(self.every):
            self.bar.update(int(self.count()))
