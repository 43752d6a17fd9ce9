"""Exports for deployment: TFLite (float and int8) and ONNX files beside the SavedModel.

Each file is converted from the SavedModel's own serving functions (``trainer.export``),
so the input_fn's preprocessing is inside wherever the converter has its ops:

* ``tflite``: ``model.tflite``, with the SavedModel's ``serving_default`` (examples as
  stored) and ``serving_features`` (the model's features) as its two signatures;
* ``tflite_int8``: ``model_int8.tflite``, weights and activations in int8 (float
  inputs and outputs), calibrated on the eval input_fn's batches; those are features,
  so its one signature is ``serving_features``;
* ``onnx``: ``model.onnx`` (opset 17, by tf2onnx: ``pip install -e ".[onnx]"``) of
  ``serving_default``.

Where the converter lacks an op of the preprocessing (decoding a JPEG, parsing a
``tf.Example``) the file takes the model's features instead, and says so. The files
are written into the SavedModel's directory before it is renamed into place, so a
reader never sees half of one; ``check`` then runs each in its own runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging as pylogging
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import errors, whole_files
from trainer.errors import UserError
from trainer.export_formats import FORMATS, RECORD, SAVED_MODEL

DEFAULT, FEATURES = "serving_default", "serving_features"
ONNX_OPSET = 17
CALIBRATION_EXAMPLES = 512  # int8's representative data: TFLite asks for a few hundred
CHECKED_EXAMPLES = 10_000  # of the eval set, each file is checked on at most these


def check_formats(formats: Iterable[str]) -> tuple[str, ...]:
    """``formats`` checked against ``FORMATS`` and their runtimes' packages; deduplicated."""
    formats = tuple(dict.fromkeys(f for f in formats if f != SAVED_MODEL))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise UserError(
            f"export format {unknown[0]!r} is not one of {SAVED_MODEL}, {', '.join(FORMATS)}"
        )
    for name in formats:
        for package in FORMATS[name].packages:
            try:
                importlib.import_module(package)
            except ImportError:
                raise UserError(
                    f"--export_format {name} needs {package}: {FORMATS[name].install}"
                ) from None
    return formats


def extras_for(formats: tuple[str, ...], data, replaced: str | None = None):
    """What ``export.save`` calls to add the files of ``formats``; None for none.

    ``replaced``: an export of the same checkpoint that this one replaces; the files it
    has of other formats are kept (``--export_format onnx`` after ``tflite``).
    """
    kept = {f: r for f, r in recorded(replaced).items() if f not in formats} if replaced else {}
    if not formats and not kept:
        return None
    return functools.partial(write_checked, formats=formats, data=data, kept=(replaced, kept))


def log_exported(export_dir: str, formats: tuple[str, ...]) -> str:
    """Logs the line of each file ``write_checked`` recorded in ``export_dir``; the dir."""
    for record in recorded(export_dir).values() if formats else ():
        logging.info("Exported %s", record["line"])
    return export_dir


def write_checked(saved_model: str, formats: Iterable[str], data, kept=(None, {})) -> list[Check]:
    """Writes the files of ``formats`` into ``saved_model``, checks and records them.

    ``data()``: the eval input_fn's dataset, which calibrates int8 and checks each
    file. Each check's line and figures are kept in ``deployment.json``, beside those
    of the files ``kept`` (an export directory and its records) copies over.
    """
    checks = []
    if formats:
        takes = write(saved_model, formats, data)
        with _quiet():  # the interpreter's first run prints its delegate
            checks = check(saved_model, takes, data())
    replaced, records = kept
    for export_format in records:
        name = FORMATS[export_format].file
        tf.io.gfile.copy(os.path.join(replaced, name), os.path.join(saved_model, name))
    record = {**records}
    record.update({one.export_format: {"line": one.line(), **one.results()} for one in checks})
    whole_files.write_json(os.path.join(saved_model, RECORD), record)
    return checks


def recorded(export_dir: str) -> dict:
    """What ``write_checked`` recorded of an export's files; {} for a SavedModel alone."""
    return whole_files.read_json(os.path.join(export_dir, RECORD), {})


def write(saved_model: str, formats: Iterable[str], calibration) -> dict[str, dict[str, str]]:
    """Writes each format's file into ``saved_model``; what each takes (see ``_entries``).

    ``calibration``: a function returning the eval input_fn's dataset (int8 only).
    """
    loaded = tf.saved_model.load(saved_model)
    signatures = {n: f for n, f in loaded.signatures.items() if n in (DEFAULT, FEATURES)}
    exported = _Exported(saved_model, loaded, signatures, calibration)
    return {
        name: _WAYS[name].write(exported, os.path.join(saved_model, FORMATS[name].file))
        for name in formats
    }


@dataclasses.dataclass(frozen=True)
class _Exported:
    """What a format's writer converts from: the SavedModel, loaded, and its signatures."""

    directory: str
    loaded: object
    signatures: dict
    calibration: Callable[[], tf.data.Dataset]  # the eval input_fn's dataset (int8)


def _tflite_file(exported: _Exported, path: str) -> dict[str, str]:
    return _write_tflite(exported.loaded, exported.signatures, path, None)


def _tflite_int8_file(exported: _Exported, path: str) -> dict[str, str]:
    features = exported.signatures[_features(exported.signatures)]
    samples = _samples(exported.calibration(), features)
    return _write_tflite(exported.loaded, exported.signatures, path, samples)


def _onnx_file(exported: _Exported, path: str) -> dict[str, str]:
    return {"model": _write_onnx(exported.directory, exported.signatures, path)}


def _write_tflite(loaded, signatures: dict, path: str, samples: list | None) -> dict[str, str]:
    """A TFLite file of the serving signatures (int8 when ``samples`` calibrate it)."""
    names = [_features(signatures)] if samples else list(signatures)
    try:
        content = _tflite(loaded, {n: signatures[n] for n in names}, samples)
    except Exception as error:  # the converter's errors have no common class
        if len(names) == 1:
            raise UserError(f"TFLite cannot convert {names[0]}: {_first_line(error)}") from None
        _takes_features("TFLite", DEFAULT, error, path)
        return _write_tflite(loaded, {FEATURES: signatures[FEATURES]}, path, None)
    with tf.io.gfile.GFile(path, "wb") as file:
        file.write(content)
    return _entries(content, names)


def _takes_features(converter: str, name: str, error: BaseException, path: str) -> None:
    """Warns that ``path`` is made of ``serving_features``: ``name`` did not convert."""
    logging.warning(
        "%s cannot convert %s (%s): %s takes the model's features (%s)",
        converter,
        name,
        _first_line(error),
        os.path.basename(path),
        FEATURES,
    )


def _entries(content: bytes, names: list[str]) -> dict[str, str]:
    """{a TFLite file's signature: the SavedModel's it was converted from}.

    With several, each keeps its function's name (``_renamed``); with one the
    converter names it ``serving_default`` whatever the function is: an int8 file's
    ``serving_default`` takes the model's features.
    """
    with _quiet():
        keys = list(tf.lite.Interpreter(model_content=content).get_signature_list())
    return {key: key for key in keys} if len(names) > 1 else {keys[0]: names[0]}


def _tflite(loaded, signatures: dict, samples: list | None) -> bytes:
    """The converter's flatbuffer of ``signatures`` (variables frozen into constants)."""
    functions = [_renamed(name, function) for name, function in signatures.items()]
    converter = tf.lite.TFLiteConverter.from_concrete_functions(functions, loaded)
    if samples is not None:
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = lambda: iter(samples)
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    with _quiet():
        return converter.convert()


def _renamed(name: str, function):
    """``function`` (a loaded signature) as a concrete function named ``name``.

    The converter names a file's signatures after the functions; a loaded
    signature's own name is TensorFlow's ``signature_wrapper_...``.
    """
    specs = function.structured_input_signature[1]

    def call(inputs):
        return function(**inputs)

    call.__name__ = name
    return tf.function(call, input_signature=[specs]).get_concrete_function()


def _write_onnx(saved_model: str, signatures: dict, path: str) -> str:
    """An ONNX file of ``serving_default``, else of ``serving_features``; which one."""
    names = [DEFAULT, FEATURES] if FEATURES in signatures else [DEFAULT]
    for name in names:
        try:
            content = _onnx(saved_model, name)
            break
        except Exception as error:  # tf2onnx's errors have no common class
            if name == names[-1]:
                raise UserError(f"tf2onnx cannot convert {name}: {_first_line(error)}") from None
            _takes_features("tf2onnx", name, error, path)
    with tf.io.gfile.GFile(path, "wb") as file:
        file.write(content)
    return name


def _onnx(saved_model: str, signature: str) -> bytes:
    """The ONNX model of one signature; refused when an op has no ONNX counterpart.

    tf2onnx only logs such an op and writes it as it is: onnxruntime then refuses the
    file when it loads it.
    """
    import onnx  # the onnx extra, checked by ``check_formats``
    import tf2onnx
    from tf2onnx import tf_loader

    with _quiet():
        graph_def, inputs, outputs, renamed = tf_loader.from_saved_model(
            saved_model, None, None, "serve", [signature], return_tensors_to_rename=True
        )
        model, _ = tf2onnx.convert.from_graph_def(
            graph_def,
            input_names=inputs,
            output_names=outputs,
            opset=ONNX_OPSET,
            tensors_to_rename=renamed,
        )
    missing = sorted(
        {
            node.op_type
            for node in _nodes(model.graph)
            if not onnx.defs.has(node.op_type, node.domain)
        }
    )
    if missing:
        raise ValueError(f"ONNX has no op for {', '.join(missing)}")
    return model.SerializeToString()


def _nodes(graph):
    """The nodes of an ONNX graph and of the graphs inside them (loop bodies, branches)."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for inner in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                yield from _nodes(inner)


def _features(signatures: dict) -> str:
    """The name of the signature that takes the model's features."""
    return FEATURES if FEATURES in signatures else DEFAULT


def _samples(dataset: tf.data.Dataset, signature) -> list[dict]:
    """The first ``CALIBRATION_EXAMPLES`` eval features, batch by batch, as int8 wants them."""
    samples, seen = [], 0
    for element in dataset:
        samples.append(_inputs(element[0], signature))
        seen += len(next(iter(samples[-1].values())))
        if seen >= CALIBRATION_EXAMPLES:
            break
    return samples


def _inputs(features, signature) -> dict[str, np.ndarray]:
    """``features`` (a dict, or one tensor) by the signature's input names, as numpy."""
    names = list(signature.structured_input_signature[1])
    if not isinstance(features, dict):
        features = {names[0]: features}
    return {name: np.asarray(features[name]) for name in names}


def _first_line(error: BaseException) -> str:
    """The error's line (``errors.first_line``), else its type; cut to 300 characters."""
    return (errors.first_line(error) or type(error).__name__)[:300]


@contextlib.contextmanager
def _quiet():
    """The converters' and interpreters' chatter, kept off the console.

    Their Python warnings and logs (their errors are raised, and said once by the
    caller), and what their C++ prints straight to file descriptor 2 (the
    converter's settings, the interpreter's delegate).
    """
    loggers = [pylogging.getLogger(name) for name in ("tensorflow", "tf2onnx")]
    loggers.append(logging.get_absl_logger())
    levels = [logger.level for logger in loggers]  # errors become ours: tf2onnx's logs too
    sys.stderr.flush()
    saved = os.dup(2)
    with warnings.catch_warnings(), tempfile.TemporaryFile() as held:
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(pylogging.CRITICAL)
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


def check(saved_model: str, takes: dict[str, dict], dataset: tf.data.Dataset) -> list[Check]:
    """Runs each written file in its runtime beside the SavedModel; how they compare.

    On the eval set (``dataset``) through the signature taking the model's features,
    and on random examples as stored through ``serving_default`` where the file has
    it and it takes them. Up to ``CHECKED_EXAMPLES`` of the eval set: an interpreter
    on a CPU takes an ImageNet model's 50,000 images in tens of minutes.
    """
    signatures = dict(tf.saved_model.load(saved_model).signatures)
    features = _features(signatures)
    checks = {f: Check(f, entries) for f, entries in takes.items()}
    runs = {f: _WAYS[f].run(os.path.join(saved_model, FORMATS[f].file)) for f in takes}
    entry = {f: {source: name for name, source in takes[f].items()} for f in takes}
    for element in dataset:
        if checks and next(iter(checks.values())).examples >= CHECKED_EXAMPLES:
            break
        inputs = _inputs(element[0], signatures[features])
        reference = _numpy(signatures[features](**inputs))
        label = _label(element[1] if len(element) > 1 else None)
        for export_format, run in runs.items():
            if features in entry[export_format]:
                outputs = run(entry[export_format][features], inputs)
                checks[export_format].add(outputs, reference, label)
    stored = _random_stored(signatures[DEFAULT]) if features != DEFAULT else None
    for export_format, run in runs.items():
        if DEFAULT in entry[export_format] and stored is not None:
            reference = _numpy(signatures[DEFAULT](**stored))
            checks[export_format].add_stored(run(entry[export_format][DEFAULT], stored), reference)
    return list(checks.values())


def _onnx_runner(path: str):
    """``run(signature, inputs) -> outputs`` of an ONNX file, by onnxruntime."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    return lambda signature, inputs: dict(zip(names, session.run(names, inputs), strict=True))


def _tflite_runner(path: str):
    """``run(signature, inputs) -> outputs`` of a TFLite file, by TFLite's interpreter."""
    with _quiet():
        interpreter = tf.lite.Interpreter(model_path=path)
    return lambda signature, inputs: interpreter.get_signature_runner(signature)(**inputs)


@dataclasses.dataclass(frozen=True)
class _Way:
    """How a format's file is written, and run by its runtime.

    ``write(exported, path)`` gives what each of the file's signatures takes;
    ``run(path)`` gives ``run(signature, inputs) -> outputs``.
    """

    write: Callable
    run: Callable


_WAYS = {  # by the names of export_formats.FORMATS
    "tflite": _Way(_tflite_file, _tflite_runner),
    "tflite_int8": _Way(_tflite_int8_file, _tflite_runner),
    "onnx": _Way(_onnx_file, _onnx_runner),
}


def _numpy(outputs: dict) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in outputs.items()}


def _label(labels) -> np.ndarray | None:
    """The class ids of a batch, when the labels are one integer vector."""
    if isinstance(labels, dict) and len(labels) == 1:
        labels = next(iter(labels.values()))
    if labels is None or isinstance(labels, dict):
        return None
    labels = np.asarray(labels)
    return labels if labels.ndim == 1 and np.issubdtype(labels.dtype, np.integer) else None


def _classes(outputs: dict) -> np.ndarray | None:
    """The predicted class ids: the ``classes`` output, or the argmax of one [b, C] output."""
    if "classes" in outputs:
        return np.asarray(outputs["classes"])
    scores = [v for v in outputs.values() if np.asarray(v).ndim == 2]
    return np.argmax(scores[0], axis=-1) if len(scores) == 1 else None


def _random_stored(signature) -> dict[str, np.ndarray] | None:
    """64 random examples as ``serving_default`` takes them; None if sizes vary or strings."""
    rng = np.random.default_rng(0)
    found = {}
    for name, spec in signature.structured_input_signature[1].items():
        shape = spec.shape.as_list()[1:]
        if None in shape or not (spec.dtype.is_integer or spec.dtype.is_floating):
            return None
        if spec.dtype.is_integer:
            high = min(spec.dtype.max, 255) + 1
            found[name] = rng.integers(0, high, [64, *shape]).astype(spec.dtype.as_numpy_dtype)
        else:
            found[name] = rng.random([64, *shape]).astype(spec.dtype.as_numpy_dtype)
    return found


@dataclasses.dataclass
class Check:
    """How one file's outputs compare with the SavedModel's on the eval set."""

    export_format: str
    entries: dict[str, str]  # the file's signature: the SavedModel's it was made of
    examples: int = 0
    correct: int | None = None  # of the file's predicted classes, when there are labels
    reference_correct: int | None = None
    agree: int = 0  # examples whose predicted class is the SavedModel's
    difference: float = 0.0  # the largest absolute difference of a float output
    stored_difference: float | None = None  # the same, on random examples as stored

    def add(self, outputs: dict, reference: dict, label: np.ndarray | None) -> None:
        """Counts one eval batch: ``outputs`` of the file, ``reference`` of the SavedModel."""
        self.difference = max(self.difference, _difference(outputs, reference))
        classes, expected = _classes(outputs), _classes(reference)
        self.examples += len(next(iter(reference.values())))
        if classes is not None and expected is not None:
            self.agree += int(np.sum(classes == expected))
        if label is not None and classes is not None and expected is not None:
            self.correct = (self.correct or 0) + int(np.sum(classes == label))
            self.reference_correct = (self.reference_correct or 0) + int(np.sum(expected == label))

    def add_stored(self, outputs: dict, reference: dict) -> None:
        """Counts the random stored examples run through ``serving_default``."""
        self.stored_difference = _difference(outputs, reference)

    def line(self) -> str:
        """One line: the file's accuracy beside the SavedModel's, and how close they are."""
        made = ", ".join(
            source if name in (source, "model") else f"{name} of {source}"
            for name, source in self.entries.items()
        )
        parts = []
        if self.correct is not None:
            parts.append(
                f"accuracy {self.correct / self.examples:.4f} on {self.examples} eval examples "
                f"(SavedModel {self.reference_correct / self.examples:.4f}), "
                f"{self.agree / self.examples:.2%} of classes agree"
            )
        if self.examples:
            parts.append(f"outputs within {self.difference:.3g} of the SavedModel's")
        if self.stored_difference is not None:
            parts.append(
                f"{DEFAULT} within {self.stored_difference:.3g} of it on 64 random "
                "examples as stored"
            )
        if not self.examples:
            parts.append("not run on the eval set, whose features it does not take")
        return f"{self.export_format} ({FORMATS[self.export_format].file}: {made}): " + "; ".join(
            parts
        )

    def results(self) -> dict:
        """For ``--results``: the figures of ``line``."""
        found = {"file": FORMATS[self.export_format].file, "signatures": self.entries}
        found["examples"] = self.examples
        found["max_difference"] = self.difference
        if self.stored_difference is not None:
            found["stored_max_difference"] = self.stored_difference
        if self.correct is not None:
            found["accuracy"] = self.correct / self.examples
            found["saved_model_accuracy"] = self.reference_correct / self.examples
            found["agreement"] = self.agree / self.examples
        return found


def _difference(outputs: dict, reference: dict) -> float:
    """The largest absolute difference between the float outputs of both."""
    found = 0.0
    for name, expected in reference.items():
        if np.issubdtype(expected.dtype, np.floating) and name in outputs:
            gap = np.abs(np.asarray(outputs[name], np.float64) - expected)
            found = max(found, float(np.max(gap, initial=0.0)))
    return found
