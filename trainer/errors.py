"""Exceptions that end a run with a one-line message, and their exit codes.

TensorFlow's runtime errors (corrupt or missing data, failed checks) are mapped to
them here too. The command line prints the message as one line, with no traceback, and exits with
the class's ``exit_code``; library callers can catch them like any exception.
"""

import contextlib
import re

import tensorflow as tf

from trainer import exit_codes


class UserError(Exception):
    """Bad input from the user: says what is wrong, where, and how to fix it."""

    exit_code = exit_codes.USER_ERROR


class KerasValueError(UserError, ValueError):
    """A ``UserError`` where Keras raises ``ValueError`` for the same input.

    A model with no loss, a loss or metric Keras does not know: the code that catches
    Keras's error catches this one.
    """


def check_count(name: str, value, minimum: int = 1, optional: bool = False) -> None:
    """Refuses a setting that must be a whole number >= ``minimum`` (or None if optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"a whole number >= {minimum}" + (" or None" if optional else "")
        raise UserError(f"{name} must be {allowed}, got {value!r}{unquoted(value)}")


def check_flag(name: str, value) -> None:
    """Refuses a setting that must be True or False: gin's quoted ``'False'`` is true."""
    if isinstance(value, bool):
        return
    raise UserError(f"{name} must be True or False, got {value!r}{unquoted(value)}")


def check_number(
    name: str, value, minimum: float | None = None, below: float | None = None
) -> None:
    """Refuses a setting that must be a number >= ``minimum`` (and < ``below``)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and (minimum is None or value >= minimum) and (below is None or value < below):
        return
    bounds = [f">= {minimum:g}" if minimum is not None else "", f"< {below:g}" if below else ""]
    allowed = " and ".join(b for b in bounds if b)
    raise UserError(
        f"{name} must be a number{' ' + allowed if allowed else ''}, got {value!r}{unquoted(value)}"
    )


def unquoted(value) -> str:
    """How to write a number or a bool that gin was given in quotes; '' for anything else.

    ``'false'`` gives `` (in gin, write False without quotes)``, ``'0.99'`` likewise.
    """
    if not isinstance(value, str):
        return ""
    words = {"true": "True", "false": "False", "none": "None"}
    meant = words.get(value.strip().lower())
    if meant is None:
        try:
            float(value)
        except ValueError:
            return ""
        meant = value.strip()
    return f" (in gin, write {meant} without quotes)"


def check_seconds(name: str, value) -> None:
    """Refuses a setting that must be a number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UserError(f"{name} must be a number of seconds > 0, got {value!r}")


def check_instance(name: str, value, kind: type, described: str) -> None:
    """Refuses a setting that must be a ``kind`` instance (gin's @Name where @Name() was meant)."""
    if isinstance(value, kind):
        return
    if isinstance(value, type):
        got = f"the class {value.__name__} (in gin, write @{value.__name__}() with parentheses)"
    elif isinstance(value, str) and value.startswith("@"):
        got = f"the string {value!r} (in gin, write {value} without quotes)"
    else:
        got = type(value).__name__
    raise UserError(f"{name} must be {described} instance, got {got}")


class TrainingDiverged(Exception):
    """The loss became NaN or infinite; the last good checkpoint is left untouched."""

    exit_code = exit_codes.DIVERGED


class Preempted(Exception):
    """SIGTERM, SIGINT or SIGUSR1 arrived; a checkpoint was saved and the run stopped early."""

    exit_code = exit_codes.PREEMPTED
    prefix = "preempted"


class PeerLost(Preempted):
    """Another worker died or stopped answering; restarting all workers resumes the run."""

    prefix = "error"


def first_line(error: Exception | str) -> str:
    """The first line of an error's message (or of a text).

    An error raised while AutoGraph traced a function comes back as "in user code:",
    the traced frames, then ``Type: message`` (and gin's "In call to" lines); its
    line is that message.
    """
    text = str(error).strip()
    if text.startswith("in user code:"):
        lines = [line.strip() for line in text.splitlines()]
        frames = [line for line in lines if line and not line.startswith("In call to ")]
        text = re.sub(r"^[A-Za-z_][\w.]*: ", "", frames[-1], count=1)
    lines = text.splitlines()
    return lines[0] if lines else ""


def op_error_text(error: tf.errors.OpError) -> str:
    """The line of a TF runtime error that says what happened (not where it was traced)."""
    skip = ("Graph execution error", "Detected at node", "File ", "In call to configurable")
    lines = [line.strip() for line in error.message.splitlines()]
    useful = [line for line in lines if line and not line.startswith(skip + ("[[",))]
    text = useful[-1] if useful else first_line(error)
    # Eager ops wrap it: "{{function_node ...}} what happened [Op:Name] name: ".
    text = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", text)
    text = re.sub(r"\s*\[Op:\w+\]( name:.*)?$", "", text)
    # tf.debugging asserts read "assertion failed: [message] [values]" (assert_less
    # puts "[Condition ...] [x = ]" in between).
    failed = re.search(
        r"assertion failed: \[(.*?)\] (?:\[Condition.*?\] \[x .*?\] )?\[(.*?)\]", text
    )
    return f"{failed.group(1)} (got {failed.group(2)})" if failed else text


@contextlib.contextmanager
def runtime_errors(what: str):
    """Turns corrupt or missing data and failed checks at run time into one UserError."""
    try:
        yield
    except tf.errors.DataLossError as error:
        raise UserError(
            f"{what}: input data is corrupt ({op_error_text(error)}); rebuild or re-copy "
            "the data files"
        ) from None
    except tf.errors.NotFoundError as error:
        raise UserError(f"{what}: input data is missing ({op_error_text(error)})") from None
    except tf.errors.InvalidArgumentError as error:
        text = outside_a_table(error) or op_error_text(error)
        corrupt = re.match(r"input data is corrupt \(got (.*)\)$", text)
        if corrupt:  # a check of the input pipeline's own (datasets.records.indexed.RecordSource)
            raise UserError(
                f"{what}: input data is corrupt ({_unescaped(corrupt.group(1))}); rebuild or "
                "re-copy the data files"
            ) from None
        unread = re.match(r"input data cannot be read \(got (.*)\)$", text)
        if unread:  # a table's row (datasets.tables.rows.Rows), what is wrong said whole
            raise UserError(f"{what}: {_unescaped(unread.group(1))}") from None
        raise UserError(f"{what} failed: {text}") from None


def _unescaped(text: str) -> str:
    """A string tensor's value as TensorFlow prints it (quotes escaped), as written."""
    return text.replace("\\'", "'").replace('\\"', '"')


def outside_a_table(error: tf.errors.OpError) -> str | None:
    """What a lookup past the end of a table (a token id past an embedding's rows) says.

    TensorFlow's "indices[1,4] = 300 is not in [0, 257)", with the layer named from
    the failing node; None for any other error. (On a GPU such a lookup gives zeros
    instead: nothing to catch.)
    """
    found = re.search(r"indices\[([\d,]*)\] = (-?\d+) is not in \[0, (\d+)\)", error.message)
    if not found:
        return None
    where, value, size = found.groups()
    node = re.search(r"\{\{node ([^}]*)\}\}", error.message)
    parts = node.group(1).split("/") if node else []
    layer = f"layer {parts[-2]}" if len(parts) > 1 else "a lookup"
    return (
        f"id {value} (at [{where}] of the batch) is not one of the {size} rows (0 to "
        f"{int(size) - 1}) that {layer} looks up: size it to the data (an Embedding's "
        "input_dim to the tokenizer's vocab_size: @text.vocab_size() in gin), or fix the ids"
    )


def guarded(dataset: tf.data.Dataset, what: str):
    """Iterates ``dataset`` eagerly, with ``_runtime_errors`` around each element."""
    iterator = iter(dataset)
    while True:
        with runtime_errors(what):
            try:
                element = next(iterator)
            except StopIteration:
                return
        yield element
