"""Where the framework's log lines go: concise on the console, whole in trainer.log.

On the console, information goes to stdout without absl's prefix, warnings and
errors to stderr as ``warning: ...`` (``use_console``, for the command line;
``speaking``, around a call of the Python API); lines are written above a live
progress bar (``console.ProgressBar``). Everything, prefixes kept, is held in
memory until the run has really started, then appended to ``model_dir/trainer.log``
(``keep_log``), so a run that fails first leaves no trace.
"""

from __future__ import annotations

import contextlib
import functools
import logging as pylogging
import os
import re
import sys
import tempfile
import time

from trainer.console import STARTUP_LOG, ProgressBar, wants_everything


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


class _AboveTheBar(pylogging.StreamHandler):
    """Writes each line above the progress bar, if one is drawn."""

    def emit(self, record: pylogging.LogRecord) -> None:
        ProgressBar.above(lambda: super(_AboveTheBar, self).emit(record))


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

    def keep(self, model_dir: str, name: str) -> None:
        if self.file is not None or "://" in model_dir:  # object stores cannot append
            return
        self.file = open(os.path.join(model_dir, name), "a")  # noqa: SIM115 - for the run
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        command = ["python -m trainer" if sys.argv[0].endswith("__main__.py") else sys.argv[0]]
        self.file.write(f"--- {started}: {' '.join(command + sys.argv[1:])}\n")
        self.file.writelines(line + "\n" for line in STARTUP_LOG)
        self.file.writelines(self.held)
        self.file.flush()
        self.held = []

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        super().close()


_LOG: list[_HeldLog] = []  # the CLI's (use_console), or a Python call's (speaking)


def keep_log(model_dir: str, name: str = LOG_NAME) -> None:
    """The run has really started in ``model_dir``: its log goes to trainer.log there.

    Called at a training run's first checkpoint and at the end of the others; does
    nothing when no console is set up, or when called again. Workers other than the
    chief keep theirs beside it, as ``trainer-worker_<i>.log``.
    """
    for held in _LOG:
        held.keep(model_dir, name)


def end_log() -> None:
    """The run is over: the next ``keep_log`` opens the next run's log (a sweep's trials)."""
    for held in _LOG:
        if held.file is not None:
            held.file.close()
            held.file = None


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
    for handler in _concise():
        root.addHandler(handler)
    tf_logger = pylogging.getLogger("tensorflow")  # it has a handler of its own too
    for handler in list(tf_logger.handlers):
        tf_logger.removeHandler(handler)


def hold_native_stderr() -> None:
    """From now on the C++ runtime's stderr goes to trainer.log; Python's stays on the console.

    Under multi_worker a lost peer makes every collective on the way down log gRPC
    errors from C++ straight to file descriptor 2. The descriptor is pointed at a
    file, whose lines are appended to ``trainer.log`` at the end (``keep_native``);
    ``sys.stderr`` and the console's handlers move to a copy of the real one.
    """
    if wants_everything() or NATIVE:
        return
    sys.stderr.flush()
    real = os.fdopen(os.dup(2), "w", buffering=1)
    held = tempfile.NamedTemporaryFile(prefix="trainer-native-", suffix=".log", delete=False)
    os.dup2(held.fileno(), 2)
    held.close()
    NATIVE.append(held.name)
    for handler in pylogging.getLogger().handlers:
        if isinstance(handler, pylogging.StreamHandler) and handler.stream is sys.stderr:
            handler.setStream(real)
    sys.stderr = real


NATIVE: list[str] = []  # the file hold_native_stderr points file descriptor 2 at


def keep_native() -> None:
    """Appends what the C++ runtime wrote to stderr to trainer.log, if the run kept one.

    A run that kept none failed before training, with a line of its own that says why;
    the runtime's lines (a port it could not bind, say) are dropped with the file.
    """
    for path in NATIVE:
        with open(path, errors="replace") as f:
            text = f.read()
        for file in (held.file for held in _LOG if held.file is not None):
            file.write(text)
            file.flush()
        os.remove(path)  # what the runtime writes after this is lost: the run is over
    NATIVE.clear()


def _concise() -> list[pylogging.Handler]:
    """INFO of the framework to stdout, warnings and errors to stderr: no prefixes."""
    info = _AboveTheBar(sys.stdout)
    info.addFilter(_OwnInfo())
    info.setFormatter(pylogging.Formatter("%(message)s"))
    problems = _AboveTheBar(sys.stderr)
    problems.setLevel(pylogging.WARNING)
    problems.addFilter(_NotAProblem())
    problems.setFormatter(_LevelPrefix())
    return [info, problems]


def speaks(method):
    """A method that runs ``speaking(self.speaks)``: the Estimator's public calls."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with speaking(self.speaks):
            return method(self, *args, **kwargs)

    return call


@contextlib.contextmanager
def speaking(on: bool = True):
    """From Python, the lines the command line shows, and ``trainer.log``, for one call.

    The start line, each checkpoint and each evaluation on stdout, warnings on
    stderr (as Keras ``fit`` shows its progress by default); the full log goes to
    ``model_dir/trainer.log`` once the run has started (``keep_log``). Does nothing
    under the command line, which set all this up itself, inside an outer call, or
    when ``on`` is False.
    """
    if not on or _LOG:
        yield
        return
    from absl import logging

    absl_logger = logging.get_absl_logger()  # the framework logs through absl
    level = absl_logger.level
    handlers = [*_concise(), _HeldLog()]
    for handler in handlers[:2]:
        handler.addFilter(lambda record: record.name == absl_logger.name)
    root = pylogging.getLogger()  # where the user's handlers (and pytest's) see them too
    shown_twice = [h for h in root.handlers if _on_console(h)]  # absl's basicConfig()
    hidden = _From(absl_logger.name)
    for handler in shown_twice:
        handler.addFilter(hidden)
    for handler in handlers:
        root.addHandler(handler)
    absl_logger.setLevel(pylogging.INFO)
    _LOG.append(handlers[-1])
    try:
        yield
    finally:
        _LOG.remove(handlers[-1])
        absl_logger.setLevel(level)
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        for handler in shown_twice:
            handler.removeFilter(hidden)


def _on_console(handler: pylogging.Handler) -> bool:
    """Whether ``handler`` writes to the console (stdout or stderr).

    absl calls ``logging.basicConfig()`` at its first line if the root logger has no
    handler, which then writes every line again, ``INFO:absl:``-prefixed, to stderr.
    While the framework speaks, the console has its lines once, from ``_concise``.
    """
    console = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    return isinstance(handler, pylogging.StreamHandler) and handler.stream in console


class _From(pylogging.Filter):
    """Drops the records of one logger (absl's: the framework's and its libraries')."""

    def __init__(self, name: str):
        super().__init__()
        self.logger = name

    def filter(self, record: pylogging.LogRecord) -> bool:
        return record.name != self.logger


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
