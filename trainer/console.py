"""What ``python -m trainer`` shows: a quiet start, and log lines a person reads.

TensorFlow's C++ runtime writes start-up chatter straight to file descriptor 2
(CUDA probing on machines without a GPU, CPU feature notes, absl's own
"log messages before InitializeLog" line), out of reach of Python's logging.
``quiet_tensorflow_import`` imports TensorFlow with that descriptor pointed at a
buffer, keeps the lines for the run's log, and passes through any line it does not
know to be noise, so that a real problem (a GPU driver that fails on a GPU machine)
still shows. ``use_console`` gives the command line concise log lines: information
on stdout without absl's prefix, warnings and errors on stderr. ``ProgressBar`` is
training's live bar on a terminal, ``Watched`` an evaluation's; log lines are
written above them.

Both stand aside when the user asks for everything: ``--verbosity`` on the command
line, or ``TF_CPP_MIN_LOG_LEVEL=0`` in the environment.
"""

from __future__ import annotations

import contextlib
import io
import logging as pylogging
import os
import re
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


def quiet_tensorflow_import() -> None:
    """Imports TensorFlow (and finds its devices) with its C++ start-up lines held back.

    The C++ log below errors stays off for the rest of the run too (unless
    ``TF_CPP_MIN_LOG_LEVEL`` is set): its warnings repeat, in C++ terms, what a
    failed step's one line already says.
    """
    if wants_everything():
        import tensorflow  # noqa: F401

        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()  # CUDA is probed here
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode("utf-8", "replace").splitlines()
    STARTUP_LOG.extend(lines)
    for line in lines:
        if line.strip() and not NOISE.search(line):
            print(line, file=sys.stderr)


@contextlib.contextmanager
def hushed():
    """Keeps a library's chatter off the console while it does a quiet job.

    That is absl-logged INFO and warnings (TFDS logs a line per call, and warns of
    the folders its own failed lookups leave), and what it prints on stdout (TFDS's
    "Downloading and preparing" lines, though nothing downloads).
    """
    from absl import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.set_verbosity(verbosity)


class _OwnInfo(pylogging.Filter):
    """INFO and below, except what libraries log at INFO through absl.

    (TensorFlow logs "Sharding callback duration" after every checkpoint, gin each
    include it looks for.)
    """

    LIBRARIES = re.compile(
        r"[/\\](site|dist)-packages[/\\](tensorflow|keras|tensorflow_datasets|gin)[/\\]"
    )

    def filter(self, record: pylogging.LogRecord) -> bool:
        if getattr(record, "console", True) is False:  # shown by the progress display
            return False
        return record.levelno < pylogging.WARNING and not self.LIBRARIES.search(record.pathname)


class ProgressBar:
    """Training's live bar on a terminal: step/max, steps/s, ETA and the last metrics.

    Drawn by tqdm (which comes with tensorflow-datasets; rich, which Keras brings,
    redraws on a timer thread, and a step loop wants nothing running beside it). It
    is moved at block boundaries, from numbers the loop has anyway.
    """

    active: ProgressBar | None = None  # the bar on screen, which log lines go above

    def __init__(self, start: int, total: int | None, description: str, unit="step", scale=False):
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no watchdog thread beside the steps
        try:  # a terminal that reports no size (a bare pty) gets 100 columns
            follows_width = os.get_terminal_size(sys.stdout.fileno()).columns > 0
        except OSError:
            follows_width = False
        self.bar = tqdm(
            total=total,
            initial=start,
            desc=description,
            unit=unit,
            unit_scale=scale,  # 96.0k/96.0k and 139k examples/s for counts that large
            dynamic_ncols=follows_width,
            ncols=None if follows_width else 100,
            nrows=None if follows_width else 24,  # tqdm draws nothing with no rows
            file=sys.stdout,
            bar_format=(
                "{desc} {n_fmt}/{total_fmt} |{bar}| {rate_fmt} ETA {remaining}{postfix}"
                if total is not None
                else "{desc} {n_fmt}{unit}, {rate_fmt}{postfix}"
            ),
        )
        ProgressBar.active = self

    def update(self, step: int, metrics: str | None = None) -> None:
        """Moves the bar to ``step``; ``metrics`` (a formatted line) replaces the shown ones."""
        if metrics is not None:
            self.bar.set_postfix_str(metrics, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        """Leaves the bar on screen at its last state; log lines go below it again."""
        self.bar.close()
        ProgressBar.active = None


class Watched:
    """A bar for work done in one compiled call (an evaluation), read from beside it.

    A thread reads ``count()`` (a variable the call adds to) every ``every`` seconds
    and moves the bar; the call itself does nothing more.

    Args:
      count: returns how much is done so far.
      total: how much there is (an estimate is fine; None if unknown).
      description: the bar's label.
      unit: what ``count`` counts, after a space: " examples".
    """

    def __init__(self, count, total: int | None, description: str, unit: str, every=0.25):
        self.count, self.every = count, every
        self.bar = ProgressBar(0, total, description, unit, scale=True)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Watched:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        done = int(self.count())
        if exc[0] is None:
            self.bar.bar.total = done  # the estimate made exact
        self.bar.update(done)
        self.bar.close()

    def _watch(self) -> None:
        while not self.stop.wait(self.every):
            self.bar.update(int(self.count()))


class _AboveTheBar(pylogging.StreamHandler):
    """Writes each line above the progress bar, if one is drawn (tqdm.write)."""

    def emit(self, record: pylogging.LogRecord) -> None:
        if ProgressBar.active is None:
            super().emit(record)
            return
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - a log line must not end the run
            self.handleError(record)


LOG_NAME = "trainer.log"  # in model_dir: every run's full log, absl's prefixes kept


class _HeldLog(pylogging.Handler):
    """The run's full log, held in memory until the run has really started.

    Then appended to ``model_dir/trainer.log``; a run that fails first leaves no trace.
    """

    def __init__(self):
        super().__init__()
        from absl import logging

        self.setFormatter(logging.PythonFormatter())
        self.held: list[str] = []
        self.file = None

    def emit(self, record: pylogging.LogRecord) -> None:
        line = self.format(record) + "\n"
        if self.file is None:
            self.held.append(line)
            return
        self.file.write(line)
        self.file.flush()

    def keep(self, model_dir: str) -> None:
        if self.file is not None or "://" in model_dir:  # object stores cannot append
            return
        self.file = open(os.path.join(model_dir, LOG_NAME), "a")  # noqa: SIM115 - for the run
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        command = ["python -m trainer" if sys.argv[0].endswith("__main__.py") else sys.argv[0]]
        self.file.write(f"--- {started}: {' '.join(command + sys.argv[1:])}\n")
        self.file.writelines(line + "\n" for line in STARTUP_LOG)
        self.file.writelines(self.held)
        self.file.flush()
        self.held = []


_LOG: list[_HeldLog] = []  # the CLI's, once use_console made it


def keep_log(model_dir: str) -> None:
    """The run has really started in ``model_dir``: its log goes to trainer.log there.

    Called at a training run's first checkpoint and at the end of the others; does
    nothing outside the command line, or when called again.
    """
    for held in _LOG:
        held.keep(model_dir)


def use_console() -> None:
    """Log lines without absl's prefix: INFO to stdout, warnings and errors to stderr.

    The full log, prefixes kept, goes to ``model_dir/trainer.log`` (``keep_log``).
    """
    if not _LOG:
        _LOG.append(_HeldLog())
        pylogging.getLogger().addHandler(_LOG[0])
    if wants_everything():
        return
    from absl import logging

    root = pylogging.getLogger()
    root.removeHandler(logging.get_absl_handler())
    info = _AboveTheBar(sys.stdout)
    info.addFilter(_OwnInfo())
    info.setFormatter(pylogging.Formatter("%(message)s"))
    problems = _AboveTheBar(sys.stderr)
    problems.setLevel(pylogging.WARNING)
    problems.addFilter(_NotAProblem())
    problems.setFormatter(_LevelPrefix())
    root.addHandler(info)
    root.addHandler(problems)
    tf_logger = pylogging.getLogger("tensorflow")  # it has a handler of its own too
    for handler in list(tf_logger.handlers):
        tf_logger.removeHandler(handler)


class _NotAProblem(pylogging.Filter):
    """Drops what libraries log as errors that are not the run's problem.

    gin logs "Path not found" while it probes an include as a package resource, and
    then raises the error the user gets (one line, with the file and line).
    """

    def filter(self, record: pylogging.LogRecord) -> bool:
        probe = record.pathname.endswith(os.path.join("gin", "resource_reader.py"))
        return not (probe and record.getMessage().startswith("Path not found"))


class _LevelPrefix(pylogging.Formatter):
    def format(self, record: pylogging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"
