"""The command's exit codes, in one table: what each means and what a scheduler should do.

The errors (``errors.py``), the command line (``flags.py``, ``experiment.py``), the signal
handling (``preemption.py``), the workers and the launcher read them here, and the
command-line guide's table (docs/guide/command-line.md) is checked against ``TABLE``
(``tests/test_readme.py``). Nothing here imports TensorFlow: the launcher and the
flag parsing run before it loads.
"""

from __future__ import annotations

import signal
import sys

DONE = 0
USER_ERROR = 2  # a mistake in the config, flags or data: fix it, do not restart
DIVERGED = 3  # the loss became NaN or infinite: look at the run
PREEMPTED = 75  # EX_TEMPFAIL: stopped with nothing lost beyond the last checkpoint; rerun


def fail(message: str, exit_code: int = USER_ERROR, prefix: str = "error") -> None:
    """Ends the command with one line on stderr, ``prefix: message``, and ``exit_code``."""
    print(f"{prefix}: {message}", file=sys.stderr)
    sys.exit(exit_code)


def of_signal(signum: int) -> int:
    """The code of a command ended by a signal: as a shell reports it, ``128 + signum``."""
    return 128 + signum


# Code(s), what it means, what to do: the guide's table, row for row.
TABLE = (
    (str(DONE), "done", "nothing"),
    (
        str(PREEMPTED),
        "preempted, lost a peer, or a peer never started: nothing lost beyond the last checkpoint",
        "restart every worker with the same command",
    ),
    (
        str(USER_ERROR),
        "a user mistake (config, flags, data, a model_dir not shared)",
        "fix it; do not restart",
    ),
    (str(DIVERGED), "the loss diverged", "look at the run; do not restart as is"),
    (
        f"{of_signal(signal.SIGINT)}, {of_signal(signal.SIGTERM)}",
        "SIGINT or SIGTERM (128 + the signal) before training started, or a second one "
        "killed the workers",
        "restart if it was not you who stopped it",
    ),
)

# A job of several workers exits with the most telling of their codes, in this order
# (None: a crash, any code not listed).
PRECEDENCE = (USER_ERROR, DIVERGED, None, PREEMPTED, DONE)
