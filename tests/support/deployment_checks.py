"""What a digits export for deployment must hold: TFLite and ONNX files that serve as
its SavedModel does, in their own runtimes (tests/test_as_written.py checks README's
first command's export with it, rather than exporting another model the same way)."""

import io
import os
import warnings

import numpy as np
import onnxruntime
import pytest
import tensorflow as tf
from PIL import Image

from datasets import digits, pipeline
from trainer import deployment


def interpreter(path):
    with warnings.catch_warnings():  # tf.lite.Interpreter's notice of LiteRT
        warnings.simplefilter("ignore")
        return tf.lite.Interpreter(model_path=str(path))


def image_example(data: bytes) -> bytes:
    """A serialized tf.train.Example whose 'image' holds ``data``."""
    image = tf.train.Feature(bytes_list=tf.train.BytesList(value=[data]))
    return tf.train.Example(
        features=tf.train.Features(feature={"image": image})
    ).SerializeToString()


def check_tflite_and_onnx_serve_as_the_saved_model_does(export_dir, shown_dir, stdout, data_dir):
    """Float files agree with the SavedModel within 1e-5 on the stored test digits, in
    TFLite's interpreter and onnxruntime; int8 loses at most 3 points of accuracy.

    ``export_dir``: the export of tflite, tflite_int8 and onnx; ``shown_dir``: the path
    the command printed for it; ``stdout``: what the command printed.
    """
    exports = deployment.recorded(str(export_dir))
    assert sorted(os.listdir(export_dir)) == [
        "assets", "deployment.json", "fingerprint.pb", "model.onnx", "model.tflite",
        "model_int8.tflite", "saved_model.pb", "variables",
    ]  # fmt: skip
    for name, record in exports.items():
        assert f"Exported {record['line']}" in stdout, name
        assert f"{name:<12} {os.path.join(shown_dir, record['file'])}" in stdout
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
