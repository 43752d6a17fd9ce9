"""SavedModel export: fresh-process round trip, signature shapes, best exporter, EMA."""

import json
import os
import re
import socket
import subprocess
import sys

import gin
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from datasets import digits, prepare  # noqa: F401 (digits: bound in gin below)
from datasets.records import shards
from tests.support.commands import REPO, digits_args, run_cli
from trainer.cli import experiment
from trainer.settings import Summaries

LOAD_AND_PREDICT = """
import json, sys
import numpy as np, tensorflow as tf
from datasets import digits
signatures = tf.saved_model.load(sys.argv[1]).signatures
# The images as digits.py stores them (uint8, 0-255): the export scales them itself.
images = np.stack([e["image"] for e in digits.load("test", sys.argv[2]).as_numpy_iterator()])
out = {k: v.numpy().tolist() for k, v in signatures["serving_default"](image=images).items()}
# tf.Example records of datasets.prepare shards, PNG and raw, in the test split's order.
for shards in sys.argv[3:]:
    records = tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(shards + "/test-*.tfrecord")))
    examples = tf.constant(list(records.as_numpy_iterator()))
    served = signatures["serving_examples"](examples=examples)["classes"].numpy().tolist()
    out[shards] = served
print(json.dumps(out))
"""


@pytest.mark.slow
def test_saved_model_in_a_fresh_process_predicts_like_the_framework(tmp_path, data_dir):
    common = digits_args(data_dir, tmp_path / "run", "--gin_param", "experiment.max_steps = 50")
    assert run_cli(*common, "--schedule", "train").returncode == 0
    predictions = tmp_path / "p.jsonl"
    assert run_cli(*common, "--schedule", "predict", "--results", str(predictions)).returncode == 0
    # What exports killed halfway leave: removed when their process is gone from this host.
    finished = subprocess.Popen(["true"])
    finished.wait()
    host = socket.gethostname()
    left = [f".tmp-{host}-{finished.pid}-a", f".tmp-{host}-{os.getpid()}-b", ".tmp-elsewhere-1-c"]
    for name in left:
        os.makedirs(tmp_path / "run" / "export" / name / "variables")
    exported = run_cli(*common, "--schedule", "export")
    assert exported.returncode == 0, exported.stderr[-2000:]
    export_dir = tmp_path / "run" / "export" / "50"
    assert sorted(os.listdir(export_dir.parent)) == sorted(["50", *left[1:]])
    assert f"exported     {export_dir}\nserve it     saved_model_cli show --dir {export_dir}" in (
        exported.stdout
    )

    prepared = []
    for image_format in ("png", "raw"):  # as `python -m datasets.prepare` writes them
        rows, count, num_classes = prepare.examples("digits", "test", data_dir)
        shards.write(rows, str(tmp_path / image_format), "test", 2, image_format, None, 10, count)
        prepared.append(str(tmp_path / image_format))
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_AND_PREDICT, str(export_dir), data_dir, *prepared],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    framework = [json.loads(line) for line in predictions.read_text().splitlines()]
    assert served["classes"] == [p["classes"] for p in framework]
    for directory in prepared:
        assert served[directory] == served["classes"], directory
    np.testing.assert_allclose(
        served["probabilities"], [p["probabilities"] for p in framework], rtol=1e-5, atol=1e-7
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, shape",
    [
        ("digits_mlp", [None, 8, 8, 1]),
        ("mnist_alexnet", [None, 28, 28, 1]),
        ("cifar10_alexnet", [None, 32, 32, 3]),
    ],
)
def test_signature_matches_the_data(tmp_path, name, shape):
    # Mock data under a data_dir of its own: the digits read from one are held for the
    # process (digits.source), and the session's data_dir must stay the real digits.
    mock_dir = tmp_path / "mock_data"
    gin.parse_config_files_and_bindings(
        [f"{REPO}/experiments/{name}.gin", f"{REPO}/experiments/smoke.gin"],
        ["Estimator.global_batch_size = 8", f"digits.input_fn.data_dir = '{mock_dir}'"],
    )
    with tfds.testing.mock_data(num_examples=16):
        experiment.experiment(model_dir=str(tmp_path), schedule="train")
        result = experiment.experiment(model_dir=str(tmp_path), schedule="export")
    signatures = tf.saved_model.load(result["export_dir"]).signatures
    # serving_default takes the images as stored, serving_features as the model sees them.
    for name, dtype in [("serving_default", tf.uint8), ("serving_features", tf.float32)]:
        inputs = signatures[name].structured_input_signature[1]
        assert list(inputs) == ["image"]
        assert inputs["image"].shape.as_list() == shape and inputs["image"].dtype == dtype
        assert set(signatures[name].structured_outputs) == {"classes", "probabilities"}
    signature = signatures["serving_default"]
    one = [1, *shape[1:]]
    assert signature(image=tf.zeros(one, tf.uint8))["classes"].shape == [1]
    expected = "[?," + ",".join(str(d) for d in shape[1:]) + "]"
    for wrong in (shape[1:], [*one, 1], [1, *shape[1:-1], shape[-1] + 1]):
        # Without a check, a conv net aborts the process on a rank-3 image, and an MLP
        # reshapes [1, 8, 8] silently.
        with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(expected)):
            signature(image=tf.zeros(wrong, tf.uint8))


@pytest.mark.slow
def test_best_exporter_keeps_the_top_k_across_restarts(tmp_path, data_dir, forked_cli):
    model_dir = tmp_path / "run"
    args = digits_args(
        data_dir,
        model_dir,
        "--gin_param",
        "experiment.eval_every_steps = 50",
        "--gin_param",
        "BestExport.metric = 'loss'",
        "--gin_param",
        "BestExport.higher = False",
        "--gin_param",
        "BestExport.keep = 2",
    )
    assert forked_cli.run(*args, "--gin_param", "experiment.max_steps = 100").returncode == 0
    best = model_dir / "export" / "best"
    first = json.loads((best / "best.json").read_text())
    assert [e["step"] for e in first] == [100, 50]  # the loss falls early in training
    assert forked_cli.run(*args, "--gin_param", "experiment.max_steps = 200").returncode == 0
    kept = json.loads((best / "best.json").read_text())
    assert len(kept) == 2 and kept[0]["value"] <= kept[1]["value"] <= first[1]["value"]
    assert sorted(p for p in os.listdir(best) if p != "best.json") == sorted(
        str(e["step"]) for e in kept
    )
    for entry in kept:
        assert tf.saved_model.contains_saved_model(str(best / str(entry["step"])))


def test_tabular_data_is_served_in_its_units_and_undeclared_input_as_its_features(tmp_path, capsys):
    """diabetes is served its ten variables as stored (standardised inside the export);
    an input_fn that declares nothing is exported as its features, and says so; its
    TFLite and ONNX files too."""
    from datasets import diabetes
    from models.linear import LinearRegression
    from trainer import Estimator

    estimator = Estimator(
        LinearRegression(), str(tmp_path / "run"), seed=0, summaries=Summaries(write_graph=False)
    )
    estimator.train(diabetes.input_fn, max_steps=5)
    signatures = tf.saved_model.load(estimator.export(diabetes.input_fn)).signatures
    x, _ = diabetes.raw("test")
    served = signatures["serving_default"](x=x)
    ours = [p for p in estimator.predict(diabetes.input_fn)]
    for name, values in served.items():  # a float32 rounding apart: 2e-9 near zero
        np.testing.assert_allclose(values.numpy(), [p[name] for p in ours], rtol=1e-5, atol=1e-7)

    def mapped(mode, params):  # a dataset made from a marked one is not marked
        return diabetes.input_fn(mode, params).map(lambda features, labels: (features, labels))

    capsys.readouterr()
    path = estimator.export(mapped, str(tmp_path / "undeclared"), formats=("tflite", "onnx"))
    assert list(tf.saved_model.load(path).signatures) == ["serving_default"]
    out = capsys.readouterr().out
    assert (
        f"Exported SavedModel to {path}; serving_default takes the features as the model sees "
        "them (x float32 [?, 10]): the input_fn declares no serving preprocessing "
        "(trainer.serves), so a client preprocesses as the input_fn does"
    ) in out
    # Its files take the features too, so both run on the eval set: a regression's
    # outputs compared, with no accuracy.
    record = json.loads(open(os.path.join(path, "deployment.json")).read())
    for name, file in (("tflite", "model.tflite"), ("onnx", "model.onnx")):
        assert record[name]["examples"] == 89 and record[name]["max_difference"] < 1e-4
        assert "accuracy" not in record[name] and f"Exported {record[name]['line']}" in out
        assert record[name]["line"].startswith(f"{name} ({file}: serving_default): outputs within ")


def test_a_prefetch_keeps_what_an_export_serves_and_a_map_is_said_to_drop_it(monkeypatch, caplog):
    from datasets import diabetes
    from trainer import InputParams, Mode, dataset_marks, serving

    served = diabetes.input_fn(Mode.PREDICT, InputParams(8, 8))
    assert serving.declared(served).stored["x"].shape == [10]
    assert serving.declared(served.prefetch(1)) is serving.declared(served)
    monkeypatch.setattr(dataset_marks, "_SAID", set())  # said once a process: this test sees it
    caplog.set_level("WARNING")
    assert serving.declared(served.map(lambda features, labels: (features, labels))) is None
    assert (
        "marked serving, but a Map stage after the mark drops it: the export takes the "
        "model's features, not stored examples: mark the dataset the input_fn returns with "
        "trainer.serves, its features_of doing the map"
    ) in caplog.text
