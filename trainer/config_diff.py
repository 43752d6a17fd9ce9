"""Two gin config texts compared binding by binding.

Used where one run's configuration must equal another's: a resumed run against the
one its checkpoints were trained with (``gin_config.check_resumable``), and each
worker of a multi-worker run against the chief (``workers.Workers``).
"""

from __future__ import annotations

import gin
from gin import config_parser


def differences(old: str, new: str, ignored: set[str] = frozenset()) -> list[str]:
    """``'scope/Configurable.param: old -> new'`` for each binding that differs.

    ``ignored`` names ``'Configurable.param'`` bindings that may differ; any
    ``data_dir`` parameter may too (where the data is, not what it is).
    """
    old_bindings, new_bindings = _bindings(old), _bindings(new)
    changes = []
    for key in sorted(set(old_bindings) | set(new_bindings)):
        short = key.split("/")[-1]
        configurable, param = short.rsplit(".", 1)
        short = configurable.split(".")[-1] + "." + param
        if short in ignored or param == "data_dir":
            continue
        before, after = old_bindings.get(key, "(unset)"), new_bindings.get(key, "(unset)")
        if before != after:
            changes.append(f"{key}: {before} -> {after}")
    return changes


def _bindings(text: str) -> dict[str, str]:
    """``{'scope/Configurable.param': value text}`` of a gin config text."""
    delegate = gin.config.ParserDelegate(skip_unknown=True)
    found = {}
    for statement in config_parser.ConfigParser(text, delegate):
        if isinstance(statement, config_parser.BindingStatement):
            scope = f"{statement.scope}/" if statement.scope else ""
            found[f"{scope}{statement.selector}.{statement.arg_name}"] = _value_text(
                statement.value
            )
    return found


def _value_text(value) -> str:
    selector = getattr(value, "_selector", None)  # a @reference: gin keeps its name here
    if selector is not None:
        return f"@{selector}{'()' if getattr(value, '_evaluate', False) else ''}"
    return repr(value)
