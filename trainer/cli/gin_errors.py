"""Gin's mistakes said in one line: where, what, and the line to write instead.

``parse_error`` turns a parse error into ``file:line: message`` with the closest
real configurable, parameter or module; ``unused_macro`` catches a ``--gin_param``
that gin would silently take as an unused macro; ``call_error`` explains a
configurable that could not be called with its settings.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import inspect
import os
import pathlib
import re
import tokenize
import typing

from trainer import errors, internals, settings
from trainer.cli import gin_syntax


def check_binding_types() -> None:
    """Refuses a binding whose value is not of its parameter's annotated type.

    Every configurable's: models, input_fns, recipes, the settings groups. Gin binds a
    quoted ``'False'`` as a string, which Python reads as true, and ``'4'`` as a string
    a model then fails on far from the gin file. Values gin makes later (references,
    macros) and parameters with no annotation are left to their configurable.

    Raises:
      UserError: ``Configurable.param must be ..., got ...`` and how to write it.
    """
    registry = internals.gin_registry()
    for (_, selector), bindings in internals.gin_bindings().items():
        found = registry.get_match(selector)
        hints = _hints(found.wrapped) if found is not None else {}
        for param, value in bindings.items():
            if param in hints and not _made_by_gin(value):
                settings.check_type(f"{found.name}.{param}", hints[param], value)


def _hints(wrapped) -> dict:
    """A function's or a class's constructor's annotations, resolved; {} if they cannot be."""
    function = wrapped.__init__ if inspect.isclass(wrapped) else wrapped
    try:
        return typing.get_type_hints(function)
    except Exception:  # a name only a type checker imports: nothing to check by
        return {}


def _made_by_gin(value) -> bool:
    """Whether ``value`` holds a reference or a macro, which gin makes when it is called."""
    if isinstance(value, dict):
        return any(_made_by_gin(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_made_by_gin(v) for v in value)
    return hasattr(value, "_scoped_selector") or type(value).__name__.endswith("Reference")


def unused_macro(params: list[str]) -> str | None:
    """A ``--gin_param 'name = value'`` that sets nothing: gin made it a macro no one uses."""
    used = set()

    def collect(value):
        selector = getattr(value, "_scoped_selector", None)  # %name is a reference to name
        if isinstance(selector, str) and selector.endswith("/gin.macro"):
            used.add(selector[: -len("/gin.macro")])
        for item in value.values() if isinstance(value, dict) else []:
            collect(item)
        for item in value if isinstance(value, (list, tuple)) else []:
            collect(item)

    for bindings in internals.gin_bindings().values():
        collect(dict(bindings))
    for param in params:
        binding = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(.*?)\s*", param, re.S)
        if binding and binding.group(1) not in used:
            name, value = binding.groups()
            owners = _owners_of(name)
            fix = " or ".join(f"'{owner}.{name} = {value}'" for owner in owners[:3])
            fix = f"write {fix}" if fix else f"name its configurable, or use it as %{name}"
            return (
                f"--gin_param '{param}' sets nothing: without a 'Configurable.' in front, "
                f"{name} is a macro no setting uses ({fix})"
            )
    return None


def _owners_of(parameter: str) -> list[str]:
    """The configurables (by their shortest name) that take a ``parameter`` so named."""
    owners = []
    for selector, configurable in internals.gin_registry().items():
        try:
            names = _parameters(configurable.wrapped)
        except (TypeError, ValueError):  # no signature to read
            continue
        if parameter in names:
            owners.append(selector.split(".")[-1])
    return sorted(set(owners), key=lambda owner: (owner != "experiment", owner))


def parse_error(error: Exception, source: str) -> str:
    """Turns gin's multi-line parse error into ``file:line: message (hint)``.

    Syntax (``gin_syntax``, also read before TensorFlow loads), an include not found,
    or a name that is not a configurable, parameter or module, with the closest real one.
    """
    if isinstance(error, (tokenize.TokenError, SyntaxError)):
        return gin_syntax.syntax_error(error, source)
    text = str(error)
    where = re.search(r'In file "([^"]+)", line (\d+)', text)
    location = f"{where.group(1)}:{where.group(2)}" if where else source
    message = text.splitlines()[0].rstrip(".")
    # gin shows the failing line; an include of a file not there fails as an OSError.
    include = re.search(r"^\s*include\s+['\"]([^'\"]+)['\"]\s*$", text, re.M)
    if include and not os.path.isfile(include.group(1)):
        return gin_syntax.include_not_found(location, include.group(1))
    return f"{location}: {message}{_closest_name_hint(message)}"


def _closest_name_hint(message: str) -> str:
    """Names the nearest real configurable, module or parameter for a misspelt one."""
    registry = internals.gin_registry()
    missing = re.search(r"No configurable matching (?:reference )?'@?([\w.]+)", message)
    if missing:
        return _configurable_hint(missing.group(1), registry)
    param = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", message)
    denied = re.search(r"Configurable '([^']+)' has denylisted kwarg '([^']+)'", message)
    if denied:
        return _made_by_the_command_line(denied.group(1), denied.group(2))
    if param and param.group(1).endswith("Estimator") and param.group(2) in settings.MOVED:
        now = settings.MOVED[param.group(2)]
        return f": it is {now} now (trainer/settings.py): write '{now} = ...' instead"
    if param:
        configurable = registry.get_match(param.group(1))
        if configurable is not None:
            names = _parameters(configurable.wrapped)
            close = _did_you_mean(param.group(2), names)
            return close or f"; it takes {', '.join(names)}"
    module = re.search(r"No module named '([\w.]+)'", message)
    if module:
        return _module_hint(module.group(1), sorted(_project_modules()))
    return ""


def _module_hint(name: str, modules: list[str]) -> str:
    """Where a module the .gin file imports is now, or the nearest names to a misspelt one.

    ``datasets.tfrecord`` became ``datasets.records.tfrecord``: a module of the same
    last name, and only one, is where it went.
    """
    last = name.rsplit(".", 1)[-1]
    moved = [m for m in modules if m.rsplit(".", 1)[-1] == last and m != name]
    if len(moved) == 1:
        return f"; it is {moved[0]} now: write 'import {moved[0]}' instead"
    return _did_you_mean(name, sorted({*modules, "models", "datasets", "trainer"}))


# What the command line gives the Estimator itself, and where the user sets it.
GIVEN = {
    "model_fn": "experiment.model_fn",
    "model_dir": "--model_dir",
    "seed": "experiment.seed",
    "config": "the gin files themselves",
    "tracker": "--tracking_uri or experiment.tracker",
}


def _made_by_the_command_line(configurable: str, parameter: str) -> str:
    """Why a binding the command line makes itself is refused, and the one to write."""
    groups = dict(zip(settings.ARGUMENTS, (*settings.GROUPS, settings.RunConfig), strict=True))
    group = groups.get(parameter)
    if group is not None and group in settings.GROUPS:
        field = dataclasses.fields(group)[0].name
        return (
            f": the command line makes {configurable}.{parameter} from the {group.__name__} "
            f"bindings: bind its fields instead, e.g. '{group.__name__}.{field} = ...'"
        )
    if parameter in GIVEN:
        return f": the command line gives it; set {GIVEN[parameter]} instead"
    return ": the command line gives it"


def _configurable_hint(name: str, registry) -> str:
    """``name`` is not registered: the closest that are, or the module to import."""
    known = {}  # each way gin accepts a name ('digits.input_fn'), to the configurable
    for selector, _ in registry.items():
        parts = selector.split(".")
        known.update({".".join(parts[i:]): selector for i in range(len(parts))})
    elsewhere = {}  # configurables of this project whose module the config does not import
    for module, names in _project_modules().items():
        for short in names:
            for form in (short, f"{module.split('.')[-1]}.{short}", f"{module}.{short}"):
                if form not in known:
                    elsewhere.setdefault(form, module)
    if name in elsewhere:
        return f"; it is in {elsewhere[name]}: add 'import {elsewhere[name]}' to the .gin file"
    close = _did_you_mean(name, known)
    if close:
        return close
    close = difflib.get_close_matches(name, sorted(elsewhere), n=1)
    if close:
        module = elsewhere[close[0]]
        return (
            f"; did you mean {close[0]!r}? It is in {module}: add 'import {module}' "
            "to the .gin file"
        )
    return "; is the module that defines it imported in the .gin file?"


def _did_you_mean(name: str, names: list[str] | dict[str, str]) -> str:
    """``"; did you mean 'a' or 'b'?"``: the (at most three) names closest to ``name``.

    ``names`` may map each name to what it names; one name is given of each.
    """
    meaning = names if isinstance(names, dict) else {n: n for n in names}
    spelt = {}  # lower case to the names spelt so ('smallcnn' finds 'SmallCNN')
    for candidate in sorted(meaning):
        spelt.setdefault(candidate.lower(), candidate)
    close, seen = [], set()
    for lower in difflib.get_close_matches(name.lower(), list(spelt), n=20, cutoff=0.6):
        candidate = spelt[lower]
        if meaning[candidate] not in seen and len(close) < 3:
            seen.add(meaning[candidate])
            close.append(repr(candidate))
    if not close:
        return ""
    listed = close[0] if len(close) == 1 else f"{', '.join(close[:-1])} or {close[-1]}"
    return f"; did you mean {listed}?"


def _project_modules() -> dict[str, list[str]]:
    """The gin configurables of each module of ``models`` and ``datasets``, by module.

    Read from the source, so without importing anything.
    """
    found = {}
    for package in ("models", "datasets"):
        spec = importlib.util.find_spec(package)
        for top in (spec.submodule_search_locations or []) if spec else []:
            for directory, _, filenames in sorted(os.walk(top)):
                prefix = ".".join([package, *pathlib.Path(directory).relative_to(top).parts])
                for filename in sorted(f for f in filenames if f.endswith(".py")):
                    if not filename.startswith("_"):
                        with open(os.path.join(directory, filename)) as f:
                            names = CONFIGURABLE.findall(f.read())
                        found[f"{prefix}.{filename[:-3]}"] = [a or b for a, b in names]
    return found


# A ``@gin.configurable`` (optionally named) ``class`` or ``def`` in a source file.
CONFIGURABLE = re.compile(
    r'^@gin\.configurable(?:\((?:"([\w.]+)")?[^)]*\))?\s*\n(?:@.*\n)*(?:class|def) (\w+)', re.M
)


def _parameters(fn) -> list[str]:
    target = fn.__init__ if isinstance(fn, type) else fn
    return [p for p in inspect.signature(target).parameters if p not in ("self", "args", "kwargs")]


def call_error(error: Exception) -> str | None:
    """One line for a gin configurable that could not be called with its settings.

    A macro without a value, required settings left out, a class whose constructor
    refused its settings, an input_fn called in the gin file (``@fn()``). None for
    any other error (a bug in the user's code keeps its traceback).
    """
    text = str(error)
    macro = re.search(r"In call to configurable 'macro' .* in scope '([^']+)'", text)
    if macro:
        name = macro.group(1)
        return f"%{name} is used but never given a value: add '{name} = ...' to a .gin file"
    missing = re.search(r"Required bindings for `([^`]+)` not provided in config: \[(.*)\]", text)
    if missing:
        name, params = missing.group(1), missing.group(2).replace("'", "").split(", ")
        return (
            f"{name} needs values for {', '.join(params)}: add e.g. "
            f"'{name}.{params[0]} = ...' to the .gin file, or --gin_param"
        )
    called = re.search(r"In call to configurable '([^']+)' \((<class|<function)", text)
    if not called or called.group(1) == "experiment":
        return None
    name, why = called.group(1), errors.first_line(error)
    if called.group(2) == "<function":  # a function gin called itself: only @fn() does
        if "required positional arguments: 'mode' and 'params'" not in why:
            return None
        return f"{name} is called in the gin file ({why}): name an input_fn without parentheses"
    settings = ", ".join(f"{k}={v!r}" for k, v in _settings_of(name).items())
    return f"{name}({settings}) failed: {why}"


def _settings_of(name: str) -> dict:
    """The gin settings of configurable ``name`` (unscoped)."""
    for (scope, selector), params in internals.gin_bindings().items():
        if not scope and selector.rsplit(".", 1)[-1] == name:
            return dict(params)
    return {}
