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

from tests.conftest import REPO, digits_args, run_cli
from trainer import cli

LOAD_AND_PREDICT = """
import json, sys
import numpy as np, tensorflow as tf
from datasets import digits
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
images = np.stack([e["image"] for e in digits.load("test", sys.argv[2]).as_numpy_iterator()])
out = serve(image=tf.constant(images.astype("float32") / 255.0))
print(json.dumps({k: v.numpy().tolist() for k, v in out.items()}))
"""


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

    proc = subprocess.run(
        [sys.executable, "-c", LOAD_AND_PREDICT, str(export_dir), data_dir],
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
    np.testing.assert_allclose(
        served["probabilities"], [p["probabilities"] for p in framework], rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize(
    "experiment, shape",
    [
        ("digits_mlp", [None, 8, 8, 1]),
        ("mnist_alexnet", [None, 28, 28, 1]),
        ("cifar10_alexnet", [None, 32, 32, 3]),
    ],
)
def test_signature_matches_the_data(tmp_path, data_dir, experiment, shape):
    gin.parse_config_files_and_bindings(
        [f"{REPO}/experiments/{experiment}.gin", f"{REPO}/experiments/smoke.gin"],
        ["Estimator.global_batch_size = 8", f"digits.input_fn.data_dir = '{data_dir}'"],
    )
    with tfds.testing.mock_data(num_examples=16):
        cli.experiment(model_dir=str(tmp_path), schedule="train")
        result = cli.experiment(model_dir=str(tmp_path), schedule="export")
    signature = tf.saved_model.load(result["export_dir"]).signatures["serving_default"]
    inputs = signature.structured_input_signature[1]
    assert list(inputs) == ["image"]
    assert inputs["image"].shape.as_list() == shape and inputs["image"].dtype == tf.float32
    assert set(signature.structured_outputs) == {"classes", "probabilities"}
    one = [1, *shape[1:]]
    assert signature(image=tf.zeros(one))["classes"].shape == [1]
    expected = "[?," + ",".join(str(d) for d in shape[1:]) + "]"
    for wrong in (shape[1:], [*one, 1], [1, *shape[1:-1], shape[-1] + 1]):
        # Without a check, a conv net aborts the process on a rank-3 image, and an MLP
        # reshapes [1, 8, 8] silently.
        with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(expected)):
            signature(image=tf.zeros(wrong))


def test_best_exporter_keeps_the_top_k_across_restarts(tmp_path, data_dir):
    model_dir = tmp_path / "run"
    args = digits_args(
        data_dir,
        model_dir,
        "--gin_param",
        "experiment.eval_every_steps = 50",
        "--gin_param",
        "Estimator.export_best_metric = 'loss'",
        "--gin_param",
        "Estimator.export_best_higher = False",
        "--gin_param",
        "Estimator.export_best_keep = 2",
    )
    assert run_cli(*args, "--gin_param", "experiment.max_steps = 100").returncode == 0
    best = model_dir / "export" / "best"
    first = json.loads((best / "best.json").read_text())
    assert [e["step"] for e in first] == [100, 50]  # the loss falls early in training
    assert run_cli(*args, "--gin_param", "experiment.max_steps = 200").returncode == 0
    kept = json.loads((best / "best.json").read_text())
    assert len(kept) == 2 and kept[0]["value"] <= kept[1]["value"] <= first[1]["value"]
    assert sorted(p for p in os.listdir(best) if p != "best.json") == sorted(
        str(e["step"]) for e in kept
    )
    for entry in kept:
        assert tf.saved_model.contains_saved_model(str(best / str(entry["step"])))
