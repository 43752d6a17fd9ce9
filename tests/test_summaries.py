"""TensorBoard writers on their own, read back with TensorBoard's loader."""

import json

import numpy as np
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from tests.support.helpers import event_tags, scalar_series
from trainer.summaries import Writers


def test_scalars_text_histograms_and_images_land_in_their_directory(tmp_path):
    writers = Writers(str(tmp_path))
    writers.scalars("train", 5, {"loss": 0.5, "accuracy": 0.75})
    writers.scalars("train", 10, {"loss": 0.25})
    writers.text("train", "operative_config", "a = 1\nb = 2", 10)
    writers.histograms("train", 10, [tf.Variable(np.arange(6.0), name="w")])
    images = np.zeros([3, 8, 8, 1], np.float32)
    writers.labelled_images("eval_test", 10, images, [1, 2, 3], [1, 0, 3])
    writers.close()
    assert scalar_series(str(tmp_path / "train"), "loss") == [(5, 0.5), (10, 0.25)]
    assert {"loss", "accuracy", "operative_config", "w:0"} <= event_tags(str(tmp_path / "train"))
    images_seen = event_accumulator.EventAccumulator(
        str(tmp_path / "eval_test"), size_guidance={"tensors": 0}
    )
    images_seen.Reload()
    (event,) = images_seen.Tensors("labelled_inputs")
    assert event.step == 10
    # width, height, then one PNG per image: three annotated images of 96 pixels.
    assert len(tf.make_ndarray(event.tensor_proto)) == 2 + 3


def test_metrics_file_holds_a_line_per_scalar_write_and_none_twice_after_resume(tmp_path):
    writers = Writers(str(tmp_path))
    for step in (10, 20, 30):  # a first run; its checkpoint was at 20, it died after 30
        writers.scalars("train", step, {"loss": 1.0 / step})
    writers.scalars("eval_test", 20, {"accuracy": 0.5})
    path = tmp_path / "metrics.jsonl"
    assert len(path.read_text().splitlines()) == 4

    resumed = Writers(str(tmp_path)).metrics
    resumed.resume(20)
    resumed.append("train", 30, {"loss": 0.03})
    assert len(path.read_text().splitlines()) == 4  # held until the run has started
    resumed.start()
    resumed.append("train", 40, {"loss": 0.025})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["writer"], r["step"]) for r in records] == [
        ("train", 10),
        ("train", 20),
        ("eval_test", 20),
        ("train", 30),
        ("train", 40),
    ]
    assert records[3]["loss"] == 0.03 and isinstance(records[0]["time"], float)


def test_a_run_that_starts_before_its_first_log_step_leaves_an_empty_metrics_file(tmp_path):
    metrics = Writers(str(tmp_path)).metrics
    metrics.resume(0)
    metrics.start()  # its first checkpoint came before any log step
    assert (tmp_path / "metrics.jsonl").read_text() == ""
