"""SavedModel export: signatures from examples to predictions.

``serving_default`` takes the examples as the input_fn's data stores them and
preprocesses them as training does, when the input_fn declares how
(``trainer.serving``); otherwise it takes the features the input_fn yields in PREDICT
mode. Shapes have a free batch dimension (channels and sizes match the data: 1
channel for digits and MNIST, 3 for CIFAR). Exports are written to a temporary
directory and renamed when complete, so a reader never sees half an export.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
import uuid
from collections.abc import Callable

import tensorflow as tf
from absl import logging

from trainer import owned_dirs, whole_files
from trainer.errors import UserError
from trainer.export_formats import FORMATS, RECORD
from trainer.model_fn import Mode, ModelFn
from trainer.serving import Serving

BEST_STATE = "best.json"
IMPORTS = "assets.extra/imports.json"  # modules whose ops the export runs


def load_export(export_dir: str):
    """The SavedModel in ``export_dir``, the modules its ops need imported first.

    Raises:
      UserError: in one line, naming the module to install and import, when one is
        missing or the export runs an op this process has not registered.
    """
    needed = whole_files.read_json(os.path.join(export_dir, IMPORTS), [])
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError:
            raise UserError(
                f"{export_dir} runs ops of {name} (its preprocessing: a tokenizer) and "
                f"{name} cannot be imported here: install it (pip install "
                f"{name.replace('_', '-')}), then load it again"
            ) from None
    try:
        return tf.saved_model.load(export_dir)
    except RuntimeError as error:
        op = re.search(r"Op type not registered '(\w+)'", str(error))
        if op is None:
            raise
        named = f"import {', '.join(needed)}" if needed else "import the library that defines it"
        raise UserError(
            f"{export_dir} runs the op {op.group(1)}, which this process has not registered: "
            f"{named} before loading it (tensorflow_text's, for a WordPiece or SentencePiece "
            "tokenizer)"
        ) from None


class _Serving(tf.Module):
    """What is saved: the model's variables and its serving functions (``signatures``)."""

    def __init__(self, model_fn: ModelFn, features_spec, serving: Serving | None):
        super().__init__(name="serving")
        self.model_fn, self.serving = model_fn, serving
        if serving is not None and isinstance(serving.features_of, tf.Module):
            self.preprocessing = serving.features_of  # tracked: a tokenizer's tables saved
        signature = tf.nest.map_structure(
            lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype), features_spec
        )
        if isinstance(signature, dict):  # name the inputs after the feature keys
            signature = {k: tf.TensorSpec(s.shape, s.dtype, name=k) for k, s in signature.items()}
        self.signature = signature
        self.serve_features = tf.function(self._serve_features, input_signature=[signature])
        if serving is not None:
            stored = serving.signature()
            self.serve_stored = tf.function(
                lambda features: self._serve_features(serving.features(_checked(features, stored))),
                input_signature=[stored],
            )
            if serving.parse_examples is not None:
                self.serve_examples = tf.function(
                    lambda examples: self.serve_stored(serving.parse_examples(_protos(examples))),
                    input_signature=[tf.TensorSpec([None], tf.string, name="examples")],
                )

    def signatures(self) -> dict:
        """The SavedModel's signatures by name (see ``trainer.serving``)."""
        if self.serving is None:
            return {"serving_default": self.serve_features}
        found = {"serving_default": self.serve_stored, "serving_features": self.serve_features}
        if self.serving.parse_examples is not None:
            found["serving_examples"] = self.serve_examples
        return found

    def _serve_features(self, features):
        features = _checked(features, self.signature)
        return dict(self.model_fn(features, None, Mode.PREDICT).predictions)


def _checked(tensors, signature):
    """``tensors``, checked to have the signature's shapes.

    A signature alone lets a tensor of another rank through (into a reshape, silently,
    or into a convolution, which aborts the process).
    """
    return tf.nest.map_structure(_shape_checked, tensors, signature)


def _shape_checked(tensor: tf.Tensor, spec: tf.TensorSpec) -> tf.Tensor:
    """``tensor``, checked to have ``spec``'s shape, in the SavedModel and in its TFLite file.

    ``ensure_shape`` says it in the SavedModel. TFLite's converter drops that op, and
    its runner resizes an input to whatever it is given: a ``[2, 64]`` batch of
    ``[8, 8, 1]`` images, or channels first, ran and answered wrong. Broadcasting to the
    expected shape refuses a dimension that differs (unless it is 1), and reshaping to
    the tensor's own count of examples then refuses the 1s; either fails in TFLite's
    runner naming the op, and costs one copy of the input.
    """
    tensor = tf.ensure_shape(tensor, spec.shape)
    inner = spec.shape[1:]
    if spec.shape.rank is None or spec.shape.rank == 0 or not inner.is_fully_defined():
        return tensor
    size = max(inner.num_elements(), 1)
    dims = tf.constant(inner.as_list(), tf.int32)
    broadcast = tf.broadcast_to(tensor, tf.concat([tf.shape(tensor)[:1], dims], 0))
    examples = tf.size(tensor, out_type=tf.int32) // size
    return tf.reshape(broadcast, tf.concat([[examples], dims], 0))


def _protos(examples: tf.Tensor) -> tf.Tensor:
    """``examples``, checked to look like serialized ``tf.train.Example`` protos.

    Each is empty or starts with the tag of its ``features`` field. Other bytes (a JPEG,
    JSON, pixels) reached ParseExample, whose error echoes them; in Python that ended
    as a UnicodeDecodeError. They now fail with a message that says what is expected;
    a proto cut short fails in DecodeProto ("Failed skipping field"), without its bytes.
    """
    sound = tf.logical_or(
        tf.equal(tf.strings.length(examples), 0), tf.equal(tf.strings.substr(examples, 0, 1), "\n")
    )
    first_bad = tf.argmin(tf.cast(sound, tf.int32), output_type=tf.int32)
    check = tf.debugging.Assert(
        tf.reduce_all(sound),
        [
            "serving_examples takes serialized tf.train.Example protos, a [batch] of strings; "
            "example",
            first_bad,
            "of the batch is not one (an image or text sent as bytes?): send "
            "tf.train.Example(...).SerializeToString(), or use serving_default",
        ],
    )
    with tf.control_dependencies([check]):  # a proto cut short or damaged: said without
        sizes, _ = tf.io.decode_proto(  # its bytes, which ParseExample's error echoes
            examples, "tensorflow.Example", ["features"], [tf.string]
        )
    # A data dependency (a control one is optimised away): ParseExample runs after.
    length = tf.strings.length(examples) + tf.minimum(sizes[:, 0], 0)
    return tf.strings.substr(examples, tf.zeros_like(length), length)


def save(
    model_fn: ModelFn,
    features_spec,
    export_dir: str,
    serving: Serving | None = None,
    extras: Callable[[str], object] | None = None,
) -> str:
    """Writes a SavedModel of ``model_fn`` to ``export_dir`` (replacing it); returns the dir.

    ``serving``: how the input_fn's stored examples become features, if it declares it.
    ``extras(directory)`` adds files of the saved SavedModel (``trainer.deployment``).
    It is written under a temporary name beside it and put in place when complete
    (``trainer/owned_dirs.py``): a folder that holds anything but an export is
    refused, and of an export only its own files are replaced. Leftovers of exports
    that were killed on this host are removed first.
    """
    owned_dirs.check(export_dir, OWNER)
    parent = os.path.dirname(export_dir.rstrip("/")) or "."
    tf.io.gfile.makedirs(parent)
    _remove_abandoned(parent)
    tmp = os.path.join(parent, f"{_TMP}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}")
    module = _Serving(model_fn, features_spec, serving)
    level = logging.get_absl_logger().level
    try:
        tf.saved_model.save(module, tmp, signatures=module.signatures())
        logging.get_absl_logger().setLevel(level)
        if serving is not None and serving.imports:
            tf.io.gfile.makedirs(os.path.dirname(os.path.join(tmp, IMPORTS)))
            whole_files.write_json(os.path.join(tmp, IMPORTS), list(serving.imports))
        if extras is not None:
            extras(tmp)
    except BaseException:
        if tf.io.gfile.exists(tmp):
            tf.io.gfile.rmtree(tmp)
        raise
    finally:
        logging.get_absl_logger().setLevel(level)  # the save sets WARNING, silencing the rest
    try:
        owned_dirs.put_in_place(tmp, export_dir, OWNER)
    finally:
        owned_dirs.discard(tmp)
    logging.info("Exported SavedModel to %s; %s", export_dir, _described(module))
    return export_dir


def _described(module: _Serving) -> str:
    """What the export's serving_default takes, in words."""

    def inputs(signature) -> str:
        return ", ".join(
            f"{name} {spec.dtype.name} {spec.shape.as_list()}".replace("None", "?")
            for name, spec in (signature.items() if isinstance(signature, dict) else [])
        )

    features = inputs(module.signature)
    if module.serving is None:
        return (
            f"serving_default takes the features as the model sees them ({features}): "
            "the input_fn declares no serving preprocessing (trainer.serves), so a client "
            "preprocesses as the input_fn does"
        )
    extra = ", serving_examples serialized tf.Examples" if module.serving.parse_examples else ""
    limit = getattr(module.serving.features_of, "limit", "")  # what a request may cost
    return (
        f"serving_default takes examples as stored ({inputs(module.serving.signature())}){extra}"
        f"{f' ({limit})' if limit else ''}, serving_features the model's features ({features})"
    )


_TMP = ".tmp-"  # then the writing process's host and pid


def export_files(directory: str) -> set[str]:
    """The names of the files an export wrote in ``directory``.

    The SavedModel's, and the deployment files with their record.
    """
    ours = {"saved_model.pb", "fingerprint.pb", "variables", "assets", IMPORTS.split("/")[0]}
    ours |= {RECORD} | {spec.file for spec in FORMATS.values()}
    present = {name.rstrip("/") for name in tf.io.gfile.listdir(directory)}
    return ours & present


# An export, as the writer of the directories export_dir names (trainer/owned_dirs.py)
OWNER = owned_dirs.Owner("an export", "export_dir", "saved_model.pb", export_files)


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
        whole_files.write_json(os.path.join(self.directory, BEST_STATE), self.kept)
        return export_dir


def _ranking(path: str) -> list[dict]:
    """The kept exports' ``[{'step', 'value'}]`` from ``best.json``; refused if damaged."""
    fix = "restore it, or move it and the exports beside it away to rank anew"
    try:
        kept = whole_files.read_json(path, [])
    except whole_files.Unreadable as error:
        raise UserError(f"{error}: it ranks the best exports; {fix}") from None
    sound = isinstance(kept, list) and all(
        isinstance(e, dict) and isinstance(e.get("step"), int) and "value" in e for e in kept
    )
    if not sound:
        raise UserError(f"{path} is not a ranking of exports ({kept!r:.60}); {fix}")
    return kept
