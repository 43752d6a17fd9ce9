"""Warm start: a new model's first weights taken from another model's.

The source is a checkpoint (or a model_dir: its newest), a SavedModel directory (its
variables), or a ``.keras`` file. Each variable of this model has a name, and takes
the source's variable of the same name, after an optional map (``names``: pattern ->
replacement, ``re.sub`` on this model's name, the first pattern that matches): names
are what the source calls its variables, so they are

* for checkpoints and SavedModels, paths of attributes from the model down
  (``hidden/dense_0/_kernel``: the ModelFn's ``hidden``, its layer ``dense_0``, Keras's
  ``_kernel``), as ``tf.train.list_variables`` lists them under ``model/``;
* for ``.keras`` files, Keras paths (``dense/kernel``).

Every shape is checked before anything is assigned. A variable whose source has
another shape (a new head) is skipped and keeps its initial value; so does one the
source lacks. One line reports what was loaded, skipped and left; the optimizer
starts fresh.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Mapping

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.core.protobuf import trackable_object_graph_pb2

from trainer import checkpoints, errors
from trainer.errors import UserError

GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# Where this framework's files keep the model: checkpoints under 'model', exports
# (the SavedModel's serving module) under 'model_fn'.
MODEL_ROOTS = ("model", "model_fn")


def warm_start(
    model_fn, source: str | Source, pattern: str = ".*", names: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """Assigns ``model_fn``'s variables their values in ``source``; returns the report.

    Args:
      model_fn: the model, its variables made.
      source: a checkpoint, a model_dir, a SavedModel directory or a ``.keras`` file
        (or that ``Source``, opened already).
      pattern: only this model's variables whose Keras path matches it (``re.search``)
        are considered; the others keep their values and are not reported.
      names: ``{pattern: replacement}`` turning this model's names into the source's.

    Returns:
      ``{'loaded': [...], 'skipped': [...], 'left': [...]}``: names of this model's
      variables.

    Raises:
      UserError: the source cannot be read, or it gives no variable of this model.
    """
    wanted = [  # weights and statistics, not a dropout's random state
        v
        for v in model_fn.trainable_variables + model_fn.non_trainable_variables
        if re.search(pattern, v.path) and tf.as_dtype(v.dtype).is_floating
    ]
    found = source if isinstance(source, Source) else Source(source)
    ours = _keras_names(wanted) if found.keras_paths else object_names(model_fn, wanted)
    report: dict[str, list[str]] = {"loaded": [], "skipped": [], "left": []}
    assign = []
    for variable in wanted:
        name = ours[id(variable)]
        theirs = found.find(_mapped(name, names or {}))
        if theirs is None:
            report["left"].append(name)
            continue
        shape = tuple(found.shapes[theirs])
        if shape != tuple(variable.shape):
            report["skipped"].append(f"{name} ({shape} there, {tuple(variable.shape)} here)")
            continue
        report["loaded"].append(name)
        assign.append((variable, theirs))
    if not assign:
        raise UserError(_nothing_loaded(found.source, ours.values(), found.shapes, names))
    for variable, theirs in assign:  # every shape checked before any assignment
        value = np.asarray(found.read(theirs))
        variable.assign(value.astype(tf.as_dtype(variable.dtype).as_numpy_dtype))
    logging.info("Warm-started from %s: %s", found.path, describe(report, len(found.shapes)))
    return report


def check_source(model_fn, source: str | None) -> None:
    """Refuses ``WarmStart.source`` beside a model that loads its own weights (``LoRA.base``).

    Warm start would look for the wrapped model's weights under the wrapper's names, and
    say it loaded nothing; or, named alike, overwrite what the model loaded.
    """
    setting = getattr(model_fn, "weights_from", None)
    if source and setting:
        raise UserError(
            f"WarmStart.source = {source!r} with {type(model_fn).__name__}, whose weights "
            f"{setting} loads: unbind WarmStart.source (give {setting} the weights to start from)"
        )


def load_frozen(
    model_fn,
    source: str,
    setting: str,
    whole: str,
    fix: str,
    names: Mapping[str, str] | None = None,
) -> list:
    """Gives every variable of ``model_fn`` its value in ``source``, then freezes it.

    For a model that is another's base or copy (a LoRA's base, DPO's reference held in
    memory): all of it must load. Returns the variables it froze.

    Args:
      model_fn: the model, its variables made.
      source: a checkpoint or model_dir, as ``warm_start`` takes it.
      setting: where ``source`` was given (``'LoRA.base'``), named in the refusals.
      whole: what ``source`` must be (``'the whole model LoRA adapts'``).
      fix: what to give instead, when it is not.
      names: as ``warm_start``'s.

    Raises:
      UserError: nothing is at ``source``, or it lacks a variable of ``model_fn``.
    """
    try:
        found = Source(source)
    except UserError as error:  # its own words, but for the setting that gave it
        why = str(error).split(": ", 1)[-1].split(";")[0]
        raise UserError(
            f"{setting} {source}: {why}; train that model first, or point {setting} at its "
            "model_dir"
        ) from None
    try:
        report = warm_start(model_fn, found, names=names)
    except UserError as error:  # nothing loaded
        lacks = str(error).split(": ", 1)[-1]
        raise UserError(f"{setting} {source} is not {whole} ({lacks}): {fix}") from None
    missing = [*report["left"], *report["skipped"]]
    if missing:
        lacks = f"{len(missing)} variables are not there or differ in shape, like {missing[0]}"
        raise UserError(f"{setting} {source} is not {whole} ({lacks}): {fix}")
    frozen = model_fn.trainable_variables
    for variable in frozen:
        variable.trainable = False
    return frozen


def describe(report: Mapping[str, list[str]], available: int) -> str:
    """The report in one line: counts, and the first few names of each kind."""

    def some(names: list[str]) -> str:
        shown = ", ".join(names[:4])
        return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    parts = [
        f"loaded {len(report['loaded'])} of the source's {available} ({some(report['loaded'])})"
    ]
    if report["skipped"]:
        parts.append(
            f"skipped {len(report['skipped'])} whose shape differs ({some(report['skipped'])})"
        )
    if report["left"]:
        parts.append(
            f"left {len(report['left'])} the source lacks at their initial values "
            f"({some(report['left'])})"
        )
    return "; ".join(parts)


class Source:
    """The variables of a checkpoint, a SavedModel or a ``.keras`` file, by name.

    Attributes:
      source: the path given.
      path: what is read (a model_dir's newest checkpoint, a SavedModel's variables).
      shapes: ``{name: shape}`` of the source's model variables.
      keras_paths: whether the names are Keras paths (a ``.keras`` file) rather than
        paths of attributes (checkpoints and SavedModels).
    """

    def __init__(self, source: str):
        self.source = source
        self.keras_paths = source.endswith(".keras")
        if self.keras_paths:
            self.path, self._values = source, _keras_file(source)
            self.shapes = {name: value.shape for name, value in self._values.items()}
            return
        path = source
        if not tf.io.gfile.exists(source) and not tf.io.gfile.glob(f"{source}.index"):
            raise UserError(
                f"cannot warm-start from {source}: there is nothing there; train that "
                "model first, or set WarmStart.source to a checkpoint, model_dir, "
                "SavedModel or .keras file"
            )
        if tf.io.gfile.exists(os.path.join(source, "saved_model.pb")):
            path = os.path.join(source, "variables", "variables")
        elif tf.io.gfile.isdir(source):
            path = checkpoints.latest_checkpoint(source)
            if path is None:
                raise UserError(
                    f"cannot warm-start from {source}: the directory holds no checkpoint "
                    "(nor saved_model.pb); train that model first, or point "
                    "WarmStart.source at one"
                )
        try:
            self._reader = tf.train.load_checkpoint(path)
            shapes = self._reader.get_variable_to_shape_map()
            graph = trackable_object_graph_pb2.TrackableObjectGraph()
            graph.ParseFromString(self._reader.get_tensor(GRAPH_KEY))
        except (tf.errors.OpError, ValueError) as error:
            raise UserError(
                f"cannot warm-start from {source}: {errors.first_line(error)}"
            ) from None
        self.path, self._keys = path, _model_paths(graph)
        self.shapes = {name: shapes[key] for name, key in self._keys.items()}

    def find(self, name: str) -> str | None:
        """The source's name for this model's ``name``, None if it has none.

        A Sequential built on an ``Input`` names its variables under its own name
        (``sequential/dense/kernel``), the same model loaded from a ``.keras`` file
        does not (``dense/kernel``): in a ``.keras`` source, either finds it.
        """
        if name in self.shapes:
            return name
        below = name.split("/", 1)[-1]
        return below if self.keras_paths and below in self.shapes else None

    def read(self, name: str) -> np.ndarray:
        """The value of the source's variable ``name``."""
        if self.keras_paths:
            return self._values[name]
        return self._reader.get_tensor(self._keys[name])


def _model_paths(graph) -> dict[str, str]:
    """``{path from the model down: checkpoint key}`` of a checkpoint's variables.

    A checkpoint keys each variable by the first path that reaches it from its root
    (the optimizer's list of variables may come first), so paths are read from its
    object graph instead, breadth first from the model (the root's ``model`` or
    ``model_fn``; the root itself in a checkpoint of something else).
    """
    roots = [c.node_id for c in graph.nodes[0].children if c.local_name in MODEL_ROOTS]
    queue = collections.deque([(roots[0] if roots else 0, "")])
    seen, paths = set(), {}
    while queue:
        node, prefix = queue.popleft()
        if node in seen:
            continue
        seen.add(node)
        for attribute in graph.nodes[node].attributes:
            if attribute.name == "VARIABLE_VALUE":
                paths[prefix.rstrip("/")] = attribute.checkpoint_key
        for child in graph.nodes[node].children:
            queue.append((child.node_id, f"{prefix}{child.local_name}/"))
    return paths


def _keras_file(path: str) -> dict[str, np.ndarray]:
    try:
        model = keras.saving.load_model(path, compile=False)
    except (OSError, ValueError, TypeError) as error:
        raise UserError(f"cannot warm-start from {path}: {errors.first_line(error)}") from None
    return {v.path: v.numpy() for v in model.weights}


def _keras_names(variables: list) -> dict[int, str]:
    return {id(v): v.path for v in variables}


def object_names(model_fn, variables: list) -> dict[int, str]:
    """Each variable's path of attributes from the model down, breadth first.

    As ``_model_paths`` reads a checkpoint's, so that one model's names are the same
    on both sides.
    """
    wanted = {id(v) for v in variables}
    names: dict[int, str] = {}
    queue, seen = collections.deque([(model_fn, "")]), set()
    while queue:
        obj, prefix = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, tf.Variable | keras.Variable):
            if id(obj) in wanted:
                names.setdefault(id(obj), prefix.rstrip("/"))
            continue
        for name, child in tf.train.TrackableView.children(obj).items():
            queue.append((child, f"{prefix}{name}/"))
    for v in variables:  # a variable only Keras tracks keeps its Keras path
        names.setdefault(id(v), v.path)
    return names


def _mapped(name: str, names: Mapping[str, str]) -> str:
    for pattern, replacement in names.items():
        if re.search(pattern, name):
            return re.sub(pattern, replacement, name)
    return name


def _nothing_loaded(source: str, ours, values: Mapping, names) -> str:
    mine = ", ".join(sorted(ours)[:3])
    theirs = ", ".join(sorted(values)[:3]) or "none"
    mapped = " after WarmStart.map" if names else ""
    return (
        f"warm start from {source} loaded nothing: no variable of this model is named as "
        f"one of the source's{mapped} (this model's are like {mine}; the source's like "
        f"{theirs}): map them with WarmStart.map = {{'pattern': 'replacement'}}"
    )
