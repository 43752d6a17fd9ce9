"""Two gin config texts compared binding by binding.

Used where one run's configuration must equal another's: a resumed run against the
one its checkpoints were trained with (``gin_config.check_resumable``), and each
worker of a multi-worker run against the chief (``workers.Workers``). ``listed``
says a long list of differences in a few items: what is trained and on what first
(``DECISIVE``), a configurable bound on one side only as one item, the rest counted.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import gin
from gin import config_parser

from trainer import internals, settings
from trainer.errors import UserError

UNSET = "(unset)"
DECISIVE = ("experiment.model_fn", "experiment.input_fn")  # said first, in this order
SHOWN = 4  # items listed before "and N more"


@dataclasses.dataclass(frozen=True)
class Change:
    """One binding that differs: ``key`` is ``'scope/Configurable.param'``."""

    key: str
    before: str
    after: str

    @property
    def short(self) -> str:
        """``'Configurable.param'``: the key without scope or module."""
        return short_name(self.key)

    def __str__(self) -> str:
        return f"{self.key}: {self.before} -> {self.after}"


def short_name(key: str) -> str:
    """``'Configurable.param'`` of a ``'scope/module.Configurable.param'`` key."""
    configurable, param = key.split("/")[-1].rsplit(".", 1)
    return configurable.split(".")[-1] + "." + param


def changes(old: str, new: str, ignored: set[str] = frozenset()) -> list[Change]:
    """Each binding that differs between two config texts, by key.

    ``ignored`` names ``'Configurable.param'`` bindings that may differ; any
    ``data_dir`` parameter may too (where the data is, not what it is).
    """
    old_bindings, new_bindings = renamed(bindings(old)), bindings(new)
    found = []
    for key in sorted(set(old_bindings) | set(new_bindings)):
        change = Change(key, old_bindings.get(key, UNSET), new_bindings.get(key, UNSET))
        if change.short in ignored or change.short.endswith(".data_dir"):
            continue
        if change.before != change.after:
            found.append(change)
    return found


def differences(old: str, new: str, ignored: set[str] = frozenset()) -> list[str]:
    """``'scope/Configurable.param: old -> new'`` for each binding that differs."""
    return [str(change) for change in changes(old, new, ignored)]


def of(found: list[Change], short: str) -> Change | None:
    """The change of binding ``short`` (``'experiment.model_fn'``), if it changed."""
    return next((change for change in found if change.short == short), None)


def another_model(change: Change) -> str:
    """The model_dir's checkpoints are of another ``experiment.model_fn`` than this run's."""
    return (
        "the checkpoints in this model_dir are of another model "
        f"(experiment.model_fn: {change.before} -> {change.after})"
    )


def listed(found: list[Change]) -> str:
    """The changes in at most ``SHOWN`` items, decisive ones first, then 'and N more'.

    A configurable bound on one side only (the optimizer swapped for another, a
    model's settings) is one item: ``Adam: 15 bindings -> (unset)``.
    """
    first = [c for name in DECISIVE for c in found if c.short == name]
    items = [str(c) for c in first]
    rest = [c for c in found if c not in first]
    by_configurable = itertools.groupby(rest, key=lambda c: c.key.rsplit(".", 1)[0])
    for configurable, group in by_configurable:
        group = list(group)
        if len(group) > 1 and all(c.after == UNSET for c in group):
            items.append(f"{configurable}: {len(group)} bindings -> {UNSET}")
        elif len(group) > 1 and all(c.before == UNSET for c in group):
            items.append(f"{configurable}: {UNSET} -> {len(group)} bindings")
        else:
            items.extend(str(c) for c in group)
    more = len(items) - SHOWN
    return "; ".join(items[:SHOWN]) + (f"; and {more} more" if more > 0 else "")


def bindings(text: str) -> dict[str, str]:
    """``{'scope/Configurable.param': value text}`` of a gin config text."""
    delegate = gin.config.ParserDelegate(skip_unknown=True)
    found = {}
    for statement in config_parser.ConfigParser(text, delegate):
        if isinstance(statement, config_parser.BindingStatement):
            scope = f"{statement.scope}/" if statement.scope else ""
            selector = own_selector(statement.selector)
            found[f"{scope}{selector}.{statement.arg_name}"] = _value_text(statement.value)
    return found


def own_selector(selector: str) -> str:
    """A configurable's name as this process writes it: the shortest unique one here.

    Gin writes each binding under the shortest name unique among the configurables its
    process imported, so one process writes ``input_fn`` where another, which imported
    ``text.input_fn`` too, writes ``reversal.input_fn``: both name one configurable. A
    name this process does not know, or knows several of, stays as it is.
    """
    registry = internals.gin_registry()
    try:
        match = registry.get_match(selector)
    except KeyError:  # ambiguous here
        return selector
    return registry.minimal_selector(match.selector) if match is not None else selector


def renamed(found: dict[str, str]) -> dict[str, str]:
    """Bindings under today's names, so that a model_dir trained before the groups resumes.

    An Estimator argument now in a settings group (``Estimator.save_checkpoints_steps``)
    is that group's binding (``Checkpoints.every_steps``).
    """
    out = {}
    for key, value in found.items():
        old = re.fullmatch(r"(.*?)\bEstimator\.(\w+)", key)
        if old and old.group(2) in settings.MOVED:
            key = old.group(1) + settings.MOVED[old.group(2)]
        out[key] = value
    return out


def _value_text(value) -> str:
    selector = getattr(value, "_selector", None)  # a @reference: gin keeps its name here
    if selector is not None:
        return f"@{own_selector(selector)}{'()' if getattr(value, '_evaluate', False) else ''}"
    return repr(value)


class ConfigChanged(UserError):
    """The config differs from the one a model_dir's checkpoints were trained with.

    Another model (``experiment.model_fn`` changed) can never resume; otherwise
    ``--overwrite_config`` is suggested unless ``misfit`` says the checkpoints cannot
    fit this run's model.
    """

    def __init__(self, changes: list[Change], misfit: str | None = None):
        self.changes, self.misfit = changes, misfit
        model = of(changes, "experiment.model_fn")
        if model is not None:
            message = f"{another_model(model)}: train this one in a new --model_dir"
        elif misfit is not None:
            message = (
                "the config differs from the one the checkpoints in this model_dir were "
                f"trained with ({listed(changes)}), and they do not fit the model "
                f"it makes ({misfit}): use a new --model_dir, or restore the config they were "
                "trained with"
            )
        else:
            message = (
                "the config differs from the one the checkpoints in this model_dir were "
                f"trained with: {listed(changes)}. Use a new --model_dir, or "
                "--overwrite_config to resume anyway"
            )
        super().__init__(message)
