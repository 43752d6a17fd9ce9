"""TFDS datasets prepared as ArrayRecord: read by index from their files, exactly."""

import logging

import gin
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from datasets import digits, tfds_images
from trainer import InputParams, Mode, UserError, errors

NUM_VARIED = 40


class VariedImages(tfds.core.GeneratorBasedBuilder):
    """40 images of 40 different sizes; example i has label i (its id)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(None, None, 3)),
                    "label": tfds.features.ClassLabel(num_classes=NUM_VARIED),
                }
            ),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i in range(NUM_VARIED):
            image = np.full((10 + i, 30 - i // 2, 3), i, np.uint8)
            yield i, {"image": image, "label": i}


@pytest.fixture(scope="module")
def array_record_dir(tmp_path_factory):
    """digits and varied_images, prepared as ArrayRecord (real files, offline)."""
    root = str(tmp_path_factory.mktemp("array_record"))
    for builder in (digits.Digits, VariedImages):
        builder(data_dir=root, file_format="array_record").download_and_prepare()
    return root


def params(batch_size=32, start=0, seed=7):
    return InputParams(batch_size, batch_size, seed=seed, start_example=start)


def batches(dataset, n):
    return [tf.nest.map_structure(lambda t: t.numpy(), b) for b in dataset.take(n)]


def digits_input(mode, p, data_dir, **kwargs):
    return tfds_images.input_fn(mode, p, name="digits", data_dir=data_dir, **kwargs)


def test_array_record_split_read_by_index_matches_it_in_memory(array_record_dir, caplog):
    in_memory = batches(digits_input(Mode.TRAIN, params(), array_record_dir), 6)
    gin.bind_parameter("pipeline.memory_limit_mb", 0.01)
    with caplog.at_level(logging.INFO, logger="absl"):
        from_files = batches(digits_input(Mode.TRAIN, params(), array_record_dir), 6)
    assert "Reading digits-train-0 by index from its records (1437 examples" in caplog.text
    resumed = batches(digits_input(Mode.TRAIN, params(start=4 * 32), array_record_dir), 2)
    for got, want in zip(from_files + resumed, in_memory + in_memory[4:], strict=True):
        np.testing.assert_array_equal(got[0]["image"], want[0]["image"])
        np.testing.assert_array_equal(got[1]["label"], want[1]["label"])
    evaluated = batches(digits_input(Mode.EVAL, params(), array_record_dir), 100)
    labels = np.concatenate([b[1]["label"] for b in evaluated])
    np.testing.assert_array_equal(labels, digits.source("test").arrays["label"])


def test_images_of_varying_sizes_are_read_by_index_and_cropped(array_record_dir):
    def train(start, seed=7):
        dataset = tfds_images.input_fn(
            Mode.TRAIN,
            params(8, start, seed),
            name="varied_images",
            data_dir=array_record_dir,
            image_size=12,
            augment=True,
        )
        return batches(dataset, 10 - start // 8)

    epochs = train(0)  # 10 batches of 8: two epochs of 40
    assert epochs[0][0]["image"].shape == (8, 12, 12, 3)
    ids = [np.concatenate([b[1]["label"] for b in epochs[e * 5 : e * 5 + 5]]) for e in (0, 1)]
    assert sorted(ids[0]) == sorted(ids[1]) == list(range(NUM_VARIED))
    assert list(ids[0]) != list(ids[1])
    # Each image is its id's colour, resized and cropped, whatever its size.
    np.testing.assert_allclose(epochs[0][0]["image"][3], epochs[0][1]["label"][3] / 255, atol=1e-6)
    for got, want in zip(train(24), epochs[3:], strict=True):  # resumed mid-epoch
        np.testing.assert_array_equal(got[0]["image"], want[0]["image"])
        np.testing.assert_array_equal(got[1]["label"], want[1]["label"])


def test_a_corrupt_array_record_file_is_named_in_one_line(array_record_dir, tmp_path):
    import shutil

    shutil.copytree(f"{array_record_dir}/digits", tmp_path / "digits")
    shard = tmp_path / "digits/1.0.0/digits-train.array_record-00000-of-00001"
    data = bytearray(shard.read_bytes())
    data[2000:2100] = bytes(b ^ 0xFF for b in data[2000:2100])
    shard.write_bytes(bytes(data))
    gin.bind_parameter("pipeline.memory_limit_mb", 0.01)
    dataset = digits_input(Mode.TRAIN, params(), str(tmp_path))
    with pytest.raises(UserError) as raised:
        with errors.runtime_errors("training"):
            batches(dataset, 50)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("training: input data is corrupt (")
    assert f"in digits train at {tmp_path}/digits/1.0.0)" in message


def test_tfrecord_prepared_data_too_large_names_the_array_record_fix(data_dir, caplog):
    digits.source("train", data_dir)  # digits prepared as TFRecord, TFDS's default
    gin.bind_parameter("pipeline.memory_limit_mb", 0.01)
    with caplog.at_level(logging.WARNING, logger="absl"):
        dataset = digits_input(Mode.TRAIN, params(), data_dir)
    assert "reads digits-train in sequence" in caplog.text
    assert "`tfds build digits --file_format=array_record`" in caplog.text
    assert batches(dataset, 1)[0][0]["image"].shape == (32, 8, 8, 1)
