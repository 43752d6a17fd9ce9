"""SavedModel export: a ``serving_default`` signature from raw features to predictions.

The signature's inputs are the features the input_fn yields in PREDICT mode, with a
free batch dimension (so channels and sizes match the data: 1 channel for digits and
MNIST, 3 for CIFAR). Exports are written to a temporary directory and renamed when
complete, so a reader never sees half an export.
"""

from __future__ import annotations

import os
import socket
import uuid

import tensorflow as tf
from absl import logging

from trainer import files
from trainer.errors import UserError
from trainer.model_fn import Mode, ModelFn

BEST_STATE = "best.json"


class _Serving(tf.Module):
    """What is saved: the model's variables and one serving function."""

    def __init__(self, model_fn: ModelFn, features_spec):
        super().__init__(name="serving")
        self.model_fn = model_fn
        signature = tf.nest.map_structure(
            lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype), features_spec
        )
        if isinstance(signature, dict):  # name the inputs after the feature keys
            signature = {k: tf.TensorSpec(s.shape, s.dtype, name=k) for k, s in signature.items()}
        self.signature = signature
        self.serve = tf.function(self._serve, input_signature=[signature])

    def _serve(self, features):
        # A signature alone lets a tensor of another rank through (into a reshape,
        # silently, or into a convolution, which aborts the process): check it here.
        features = tf.nest.map_structure(
            lambda tensor, spec: tf.ensure_shape(tensor, spec.shape), features, self.signature
        )
        return dict(self.model_fn(features, None, Mode.PREDICT).predictions)


def save(model_fn: ModelFn, features_spec, export_dir: str) -> str:
    """Writes a SavedModel of ``model_fn`` to ``export_dir`` (replacing it); returns the dir.

    It is written under a temporary name beside it and renamed when complete. Such
    leftovers of exports that were killed on this host are removed first.
    """
    parent = os.path.dirname(export_dir.rstrip("/")) or "."
    tf.io.gfile.makedirs(parent)
    _remove_abandoned(parent)
    tmp = os.path.join(parent, f"{_TMP}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}")
    module = _Serving(model_fn, features_spec)
    try:
        tf.saved_model.save(module, tmp, signatures={"serving_default": module.serve})
    except BaseException:
        if tf.io.gfile.exists(tmp):
            tf.io.gfile.rmtree(tmp)
        raise
    if tf.io.gfile.exists(export_dir):
        tf.io.gfile.rmtree(export_dir)
    tf.io.gfile.rename(tmp, export_dir)
    logging.info("Exported SavedModel to %s", export_dir)
    return export_dir


_TMP = ".tmp-"  # then the writing process's host and pid


def _remove_abandoned(parent: str) -> None:
    """Removes temporary exports in ``parent`` whose writer on this host is gone."""
    host = socket.gethostname()
    for name in tf.io.gfile.listdir(parent):
        name = name.rstrip("/")
        fields = name[len(_TMP) :].rsplit("-", 2) if name.startswith(_TMP) else []
        if len(fields) == 3 and fields[0] == host and fields[1].isdigit():
            if not _alive(int(fields[1])):
                tf.io.gfile.rmtree(os.path.join(parent, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class BestExporter:
    """Keeps SavedModels of the ``keep`` best evaluations by one metric, across restarts.

    The ranking lives in ``directory/best.json``; a rerun reads it and only exports
    when a new evaluation beats the worst kept one.
    """

    def __init__(self, directory: str, metric: str, keep: int = 1, higher_is_better: bool = True):
        self.directory = directory
        self.metric = metric
        self.keep = keep
        self.higher_is_better = higher_is_better
        self.kept: list[dict] = _ranking(os.path.join(directory, BEST_STATE))

    def maybe_export(self, step: int, metrics: dict, export) -> str | None:
        """Exports (via ``export(dir)``) when ``metrics`` ranks among the best; returns the dir."""
        if self.metric not in metrics:
            raise KeyError(f"best exporter: no metric {self.metric!r} in {sorted(metrics)}")
        value = metrics[self.metric]
        if any(entry["step"] == step for entry in self.kept):
            return None
        ranked = sorted(
            [*self.kept, {"step": step, "value": value}],
            key=lambda e: e["value"],
            reverse=self.higher_is_better,
        )
        if {"step": step, "value": value} not in ranked[: self.keep]:
            return None
        export_dir = export(os.path.join(self.directory, str(step)))
        for dropped in ranked[self.keep :]:
            stale = os.path.join(self.directory, str(dropped["step"]))
            if tf.io.gfile.exists(stale):
                tf.io.gfile.rmtree(stale)
        self.kept = ranked[: self.keep]
        files.write_json(os.path.join(self.directory, BEST_STATE), self.kept)
        return export_dir


def _ranking(path: str) -> list[dict]:
    """The kept exports' ``[{'step', 'value'}]`` from ``best.json``; refused if damaged."""
    fix = "restore it, or move it and the exports beside it away to rank anew"
    try:
        kept = files.read_json(path, [])
    except files.Unreadable as error:
        raise UserError(f"{error}: it ranks the best exports; {fix}") from None
    sound = isinstance(kept, list) and all(
        isinstance(e, dict) and isinstance(e.get("step"), int) and "value" in e for e in kept
    )
    if not sound:
        raise UserError(f"{path} is not a ranking of exports ({kept!r:.60}); {fix}")
    return kept
