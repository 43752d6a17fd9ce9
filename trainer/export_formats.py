"""The files an export can add beside its SavedModel, by format: one table.

``--export_format`` takes its choices from it (``trainer/cli/flags.py``, before
TensorFlow loads: nothing here imports it), and ``trainer/deployment.py`` keeps each
format's writer and runner under the same name. A new format is a row here and an
entry there.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Format:
    """A format's file name, and the packages that write and run it (an extra's)."""

    file: str
    packages: tuple[str, ...] = ()
    install: str = ""  # how to get ``packages``


FORMATS = {
    "tflite": Format("model.tflite"),
    "tflite_int8": Format("model_int8.tflite"),
    "onnx": Format(
        "model.onnx",
        ("onnxruntime", "tf2onnx"),
        'pip install -e ".[onnx]" (tf2onnx and onnxruntime)',
    ),
}
SAVED_MODEL = "saved_model"  # always written; the flag's default
RECORD = "deployment.json"  # beside them: each file's check, in a line and figures
