"""Gin files' syntax, read before TensorFlow loads: a typo said in a tenth of a second.

``check(files, params)`` reads the files, what they include and the ``--gin_param``
bindings with gin's own parser, taking every name as known: a bracket left open,
``:`` for ``=``, a name without ``@`` or quotes, an include that is not there. Whether
the names are configurables needs their modules imported; ``gin_config.parse`` says
that later (through ``gin_errors``), and says these the same way if they get there.
"""

from __future__ import annotations

import os
import re
import tokenize

from gin import config_parser


class _AnyName(config_parser.ParserDelegate):
    """Takes every ``@name`` and ``%name`` as known: only the syntax is read here."""

    def configurable_reference(self, scoped_configurable_name, evaluate):
        del evaluate
        return scoped_configurable_name

    def macro(self, macro_name):
        return macro_name


def check(files: list[str], params: list[str]) -> str | None:
    """The first syntax mistake of the files (and what they include), then of the bindings."""
    searched = above(files)
    seen: set[str] = set()
    for path in files:
        found = _file(path, path, searched, seen)
        if found:
            return found
    return _text("\n".join(params), "--gin_param")


def above(files: list[str]) -> list[str]:
    """The directories of ``files`` and every directory above them, nearest first.

    Where an ``include`` is looked for after the working directory, so that
    ``include 'experiments/base.gin'`` works when the command runs elsewhere.
    """
    found: list[str] = []
    for path in files:
        directory = os.path.dirname(os.path.abspath(path))
        while directory not in found:
            found.append(directory)
            directory = os.path.dirname(directory)
    return found


def _file(path: str, source: str, searched: list[str], seen: set[str]) -> str | None:
    if os.path.abspath(path) in seen:  # included twice: read once
        return None
    seen.add(os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        try:
            statements = list(config_parser.ConfigParser(f, _AnyName()))
        except (SyntaxError, tokenize.TokenError) as error:
            return syntax_error(error, source)
        except UnicodeDecodeError:
            return f"{path} is not a gin file (not UTF-8 text): name the .gin file"
    for statement in statements:
        if isinstance(statement, config_parser.IncludeStatement):
            included = _found(statement.filename, searched)
            if included is None:
                where = f"{path}:{statement.location.line_num}"
                return include_not_found(where, statement.filename)
            found = _file(included, included, searched, seen)
            if found:
                return found
    return None


def _text(text: str, source: str) -> str | None:
    try:
        for _ in config_parser.ConfigParser(text, _AnyName()):
            pass
    except (SyntaxError, tokenize.TokenError) as error:
        return syntax_error(error, source)
    return None


def _found(name: str, searched: list[str]) -> str | None:
    """Where gin finds an included file: as given (from the working directory), or above."""
    for candidate in [name] + [os.path.join(d, name) for d in searched]:
        if os.path.isfile(candidate):
            return candidate
    return None


def include_not_found(where: str, name: str) -> str:
    """The line for an ``include`` of a file that is not there."""
    return (
        f"{where}: include {name!r} not found in the working directory {os.getcwd()} nor "
        "above the gin file: run from the directory it is relative to, or include it by "
        "its absolute path"
    )


def syntax_error(error: SyntaxError | tokenize.TokenError, source: str) -> str:
    """``file:line: gin syntax error: ...`` for gin's parse error in ``source``.

    A bracket left open makes gin read on and fail where the text ends or on a later
    line; the line named is then the bracket's.
    """
    line = _unclosed_bracket_line(source)
    if line and line <= (getattr(error, "lineno", None) or line):
        return f"{source}:{line}: gin syntax error: a bracket opened here is never closed"
    if isinstance(error, tokenize.TokenError):
        return f"{source}: gin syntax error: {error.args[0]} (is a bracket or quote unclosed?)"
    line = f":{error.lineno}" if error.lineno else ""
    return f"{error.filename or source}{line}: gin syntax error: {_syntax_hint(error)}"


def _syntax_hint(error: SyntaxError) -> str:
    """Gin's syntax error, said in terms of the line the user wrote and its fix."""
    text = (error.text or "").strip()
    token = re.search(r"Failed to parse token '([^']+)'", error.msg)
    if token:
        name = token.group(1)
        return (
            f"{name} is not a value gin knows (in {text!r}): write @{name}() for a new "
            f"instance of a configurable, @{name} for the class or function itself, or "
            f"'{name}' with quotes for a string"
        )
    colon = re.fullmatch(r"([\w./]+)\s*:\s*(.+)", text)
    if colon:
        return f"a binding is 'name = value': write '{colon.group(1)} = {colon.group(2)}'"
    first = (error.msg or "").strip().splitlines()
    return re.sub(r"\s*<[^>]* at 0x[0-9a-f]+>", "", first[0] if first else "")


def _unclosed_bracket_line(source: str) -> int | None:
    """The line of the first bracket a gin file (or binding) opens and never closes."""
    if not os.path.isfile(source):
        return None
    with open(source) as f:
        text = f.read()
    opened: list[int] = []
    quote = None
    for number, line in enumerate(text.splitlines(), 1):
        for char in line:
            if quote:
                quote = None if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char == "#":
                break
            elif char in "([{":
                opened.append(number)
            elif char in ")]}" and opened:
                opened.pop()
    return opened[0] if opened else None
