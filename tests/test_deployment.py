"""Exports for deployment (trainer/deployment.py): TFLite and ONNX files, run by their runtimes.

README's first command exports its model in every format, and tests/test_as_written.py
checks those files in their runtimes (tests/support/deployment_checks.py).
"""

import ast
import io
import json
import os
import pathlib

import pytest
import tensorflow as tf
from PIL import Image

from datasets import digits
from tests.support.commands import ENV, run_cli
from trainer import Estimator, InputParams, Mode, deployment, export_formats, serves
from trainer.settings import Summaries

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def png_input_fn(mode: Mode, params: InputParams) -> tf.data.Dataset:
    """A user's input_fn whose examples are stored as PNG files' bytes."""
    split = "train" if mode == Mode.TRAIN else "test[:64]"
    examples = list(digits.load(split).take(256).as_numpy_iterator())
    stored, labels = [], []
    for example in examples:
        buffer = io.BytesIO()
        Image.fromarray(example["image"][..., 0]).save(buffer, format="PNG")
        stored.append(buffer.getvalue())
        labels.append(example["label"])

    def features_of(example):
        image = tf.ensure_shape(tf.io.decode_png(example["png"], channels=1), [8, 8, 1])
        return {"image": tf.cast(image, tf.float32) / 255.0}

    dataset = tf.data.Dataset.from_tensor_slices(({"png": stored}, {"label": labels}))
    dataset = dataset.map(lambda example, label: (features_of(example), label))
    dataset = dataset.repeat() if mode == Mode.TRAIN else dataset
    dataset = dataset.batch(params.batch_size).prefetch(1)
    return serves(dataset, features_of, {"png": tf.TensorSpec([], tf.string)})


@pytest.mark.slow
def test_a_preprocessing_tflite_and_onnx_lack_leaves_the_files_the_features(tmp_path, caplog):
    """PNG decoding inside serving_default: each file takes the model's features, says
    why in a warning, and is checked on the eval set."""
    from models.mlp import MLP

    estimator = Estimator(
        MLP(hidden_units=(16,)), str(tmp_path / "run"), global_batch_size=32, seed=0,
        summaries=Summaries(write_graph=False),
    )  # fmt: skip
    estimator.train(png_input_fn, max_steps=20)
    path = estimator.export(png_input_fn, formats=("tflite", "onnx"))
    record = json.loads((tmp_path / "run" / "export" / "20" / "deployment.json").read_text())
    assert record["tflite"]["signatures"] == {"serving_default": "serving_features"}
    assert record["onnx"]["signatures"] == {"model": "serving_features"}
    for name in ("tflite", "onnx"):
        assert record[name]["examples"] == 64 and record[name]["agreement"] == 1.0, name
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        m.startswith("TFLite cannot convert serving_default (")
        and m.endswith("): model.tflite takes the model's features (serving_features)")
        for m in warned
    ), warned
    assert os.path.isfile(os.path.join(path, "model.onnx"))
    # Exported again, the same step in another format (or none): the others stay.
    onnx = (tmp_path / "run" / "export" / "20" / "model.onnx").read_bytes()
    again = estimator.export(png_input_fn, formats=("tflite",))
    assert (
        again == path and (tmp_path / "run" / "export" / "20" / "model.onnx").read_bytes() == onnx
    )
    kept = json.loads((tmp_path / "run" / "export" / "20" / "deployment.json").read_text())
    assert kept["onnx"] == record["onnx"] and set(kept) == {"tflite", "onnx"}
    estimator.export(png_input_fn)
    assert {"model.tflite", "model.onnx", "deployment.json"} <= set(os.listdir(path))


@pytest.mark.slow
def test_onnx_without_its_extra_is_one_line_before_anything_runs(model_dir, faulty_gin):
    """tf2onnx missing (a package that fails to import, as a missing one does)."""
    fake = model_dir.parent / "without_onnx"
    (fake / "tf2onnx").mkdir(parents=True)
    (fake / "tf2onnx" / "__init__.py").write_text("raise ImportError(name='tf2onnx')\n")
    env = {"PYTHONPATH": f"{fake}{os.pathsep}{ENV['PYTHONPATH']}"}
    args = ["--gin_file", faulty_gin, "--model_dir", str(model_dir), "--schedule", "export"]
    proc = run_cli(*args, "--export_format", "onnx", env=env)
    assert proc.returncode == 2
    assert proc.stderr == (
        'error: --export_format onnx needs tf2onnx: pip install -e ".[onnx]" (tf2onnx and '
        "onnxruntime)\n"
    )
    assert not (model_dir / "export").exists()


def test_the_formats_are_one_table_that_the_command_line_and_deployment_read():
    """``--export_format``'s choices are the table's names; deployment.py keeps a writer
    and a runner under each, and branches on no format's name (a new format is a row)."""
    source = (REPO_ROOT / "trainer" / "deployment.py").read_text()
    compared = [
        node.value
        for compare in ast.walk(ast.parse(source))
        if isinstance(compare, ast.Compare)
        for node in ast.walk(compare)
        if isinstance(node, ast.Constant) and node.value in export_formats.FORMATS
    ]
    assert compared == []
    assert set(deployment._WAYS) == set(export_formats.FORMATS)
    from trainer.cli import flags  # defines the command's flags in this process

    choices = flags.FLAGS["export_format"].parser.enum_values
    assert choices == ["saved_model", *export_formats.FORMATS]
