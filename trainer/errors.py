"""Exceptions that end a run with a one-line message, and their exit codes.

The command line prints the message as one line, with no traceback, and exits with
the class's ``exit_code``; library callers can catch them like any exception.
"""

EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a temporary failure; rerun to resume


class UserError(Exception):
    """Bad input from the user: says what is wrong, where, and how to fix it."""

    exit_code = EXIT_USER_ERROR


class TrainingDiverged(Exception):
    """The loss became NaN or infinite; the last good checkpoint is left untouched."""

    exit_code = EXIT_DIVERGED


class Preempted(Exception):
    """SIGTERM or SIGINT arrived; a checkpoint was saved and the run stopped early."""

    exit_code = EXIT_PREEMPTED
