"""TensorBoard writers on their own, read back with TensorBoard's loader."""

import numpy as np
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from tests.helpers import event_tags, scalar_series
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
