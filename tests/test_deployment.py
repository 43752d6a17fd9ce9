"""Exports for deployment (trainer/deployment.py): TFLite and ONNX files, run by their runtimes."""

import ast
import io
import json
import os
import pathlib
import warnings

import numpy as np
import onnxruntime
import pytest
import tensorflow as tf
from PIL import Image

from datasets import digits, pipeline
from tests.support.commands import ENV, run_cli
from trainer import Estimator, InputParams, Mode, deployment, export_formats, serves
from trainer.settings import Summaries

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def interpreter(path):
    with warnings.catch_warnings():  # tf.lite.Interpreter's notice of LiteRT
        warnings.simplefilter("ignore")
        return tf.lite.Interpreter(model_path=str(path))


@pytest.mark.slow
def test_tflite_and_onnx_files_serve_as_the_saved_model_does(model_dir, faulty_gin, data_dir):
    """Float files agree with the SavedModel within 1e-5 on the stored test digits, in
    TFLite's interpreter and onnxruntime; int8 loses at most 3 points of accuracy."""
    formats = ["--export_format", "tflite", "--export_format", "tflite_int8"]
    results = model_dir.parent / "results.json"
    args = ["--gin_file", faulty_gin, "--model_dir", str(model_dir), "--schedule", "export"]
    proc = run_cli(*args, *formats, "--export_format", "onnx", "--results", str(results), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export_dir = model_dir / "export" / "100"
    exports = json.loads(results.read_text())["exports"]
    assert sorted(os.listdir(export_dir)) == [
        "assets", "deployment.json", "fingerprint.pb", "model.onnx", "model.tflite",
        "model_int8.tflite", "saved_model.pb", "variables",
    ]  # fmt: skip
    for name, record in exports.items():
        assert f"Exported {record['line']}" in proc.stdout, name
        assert f"{name:<12} {export_dir / record['file']}" in proc.stdout
    assert exports["tflite"]["signatures"] == {
        "serving_default": "serving_default",
        "serving_features": "serving_features",
    }
    assert exports["tflite"]["examples"] == 360 and exports["tflite"]["agreement"] == 1.0
    assert exports["tflite"]["max_difference"] < 1e-5
    assert exports["tflite"]["stored_max_difference"] < 1e-5
    assert exports["tflite_int8"]["signatures"] == {"serving_default": "serving_features"}
    drop = exports["tflite_int8"]["saved_model_accuracy"] - exports["tflite_int8"]["accuracy"]
    assert drop <= 0.03 and exports["tflite_int8"]["agreement"] >= 0.95
    assert exports["onnx"]["signatures"] == {"model": "serving_default"}
    assert exports["onnx"]["stored_max_difference"] < 1e-5

    # A client's own run of each file, on the test digits as stored (uint8 pixels).
    examples = list(digits.load("test", data_dir).as_numpy_iterator())
    images = np.stack([e["image"] for e in examples])
    labels = np.array([e["label"] for e in examples])
    saved = tf.saved_model.load(str(export_dir)).signatures["serving_default"](image=images)
    tflite = interpreter(export_dir / "model.tflite").get_signature_runner("serving_default")
    session = onnxruntime.InferenceSession(str(export_dir / "model.onnx"))
    names = ["classes", "probabilities"]
    onnx = dict(zip(names, session.run(names, {"image": images}), strict=True))
    for served in (tflite(image=images), onnx):
        np.testing.assert_array_equal(served["classes"], saved["classes"].numpy())
        np.testing.assert_allclose(served["probabilities"], saved["probabilities"], atol=1e-5)
    # Bytes that are no tf.Example, sent where serialized ones go: said, not echoed (a
    # UnicodeDecodeError in Python before, from ParseExample's message).
    signatures = tf.saved_model.load(str(export_dir)).signatures
    junk = tf.constant([Image.new("L", (8, 8)).tobytes() + b"\xff\xd8", b"{}"])
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        signatures["serving_examples"](examples=junk)
    assert (
        "serving_examples takes serialized tf.train.Example protos, a [batch] of strings; "
        "example] [0] [of the batch is not one"
    ) in raised.value.message
    whole = tf.train.Example(
        features=tf.train.Features(
            feature={
                "image": tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[bytes(range(150, 256))])
                )
            }
        )
    ).SerializeToString()
    with pytest.raises(tf.errors.DataLossError, match="Failed skipping field"):  # not echoed
        signatures["serving_examples"](examples=tf.constant([whole[:40]]))
    # A client's JPEG in the Example is decoded (as serving_default serves its pixels);
    # other bytes of the wrong count are said ("Input to reshape ... 394 values" before).
    jpeg = io.BytesIO()
    Image.fromarray(images[0, :, :, 0]).save(jpeg, "JPEG", quality=95)
    served = signatures["serving_examples"](examples=tf.constant([image_example(jpeg.getvalue())]))
    decoded = tf.io.decode_jpeg(jpeg.getvalue(), channels=1)[None]
    expected = signatures["serving_default"](image=decoded)["probabilities"]
    np.testing.assert_allclose(served["probabilities"], expected, atol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        signatures["serving_examples"](examples=tf.constant([image_example(bytes(394))]))
    assert (
        "image of an Example is neither PNG nor JPEG, nor 64 bytes of uint8 pixels [8, 8, 1]"
        in (raised.value.message)
    )
    # The TFLite file refuses a batch of another layout, as the SavedModel does (its
    # runner resized the input and answered: 47 of 64 classes wrong channels first).
    for wrong in (images.reshape(len(images), 64), images.transpose(0, 3, 1, 2)):
        with pytest.raises(RuntimeError, match="BROADCAST_TO"):
            tflite(image=wrong)
        with pytest.raises((TypeError, tf.errors.InvalidArgumentError), match=r"8, 8, 1|8,8,1"):
            signatures["serving_default"](image=tf.constant(wrong))
    int8 = interpreter(export_dir / "model_int8.tflite").get_signature_runner()
    classes = int8(image=pipeline.unit_range(images).numpy())["classes"]
    accuracy = np.mean(saved["classes"].numpy() == labels)
    assert np.mean(classes == labels) >= accuracy - 0.03


def image_example(data: bytes) -> bytes:
    """A serialized tf.train.Example whose 'image' holds ``data``."""
    image = tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
    return tf.train.Example(
        features=tf.train.Features(feature={"image": image})
    ).SerializeToString()


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
