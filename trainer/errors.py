"""The one exception type the command line turns into a one-line message."""


class UserError(Exception):
    """Bad input from the user: says what is wrong, where, and how to fix it.

    The command line prints its message as one line and exits non-zero, with no
    traceback; library callers can catch it like any exception.
    """
