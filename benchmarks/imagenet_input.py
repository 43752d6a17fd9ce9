"""ImageNet-style input: JPEGs of ImageNet's sizes, decoded, cropped and resized to 224.

    PYTHONPATH=. python3 benchmarks/imagenet_input.py [--images 1024] [--batches 30]

Generates JPEGs of 300-500 px a side (smooth content with noise, quality 90, about
ImageNet's bytes per pixel), prepares them twice with ``datasets.prepare --images``
(as they are, and with ``--max_side 320``), and measures in one run, in images/s and
images/s per core, batch 128:

1. decode alone: the shards read in sequence, each JPEG decoded whole;
2. naive: the same reading, then decode whole, random-resized crop, resize to 224, flip;
3. fused: the framework's crop (only the window decoded) on the JPEG bytes held in
   memory, in order: what the framework does per image, without reading by index;
4. the framework's training pipeline (``tfrecord.input_fn``, ``image_size = 224``,
   ``augment = 'inception'``) reading by index: its records held in memory, and from
   the shards on disk (not held in memory), on the original JPEGs and on the
   ``--max_side 320`` ones.

It ends with the ratios to the naive pipeline and, from ``benchmarks/costs.py``'s
model of the ImageNet AlexNet step, how many such cores one GPU needs.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import trainer  # noqa: E402

trainer.quiet_start()  # first: TensorFlow loads without its start-up lines
from trainer import InputParams, Mode  # noqa: E402

BATCH = 128
SIZE = [224, 224]

import gin  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from datasets import folders, images  # noqa: E402
from datasets.records import shards, tfrecord  # noqa: E402


def generate(root: str, count: int, seed: int = 0) -> None:
    """``count`` JPEGs of 300-500 px a side in 4 class folders under ``root``."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        height, width = (int(s) for s in rng.integers(300, 501, 2))
        coarse = tf.constant(rng.random((1, 12, 12, 3), np.float32) * 255)
        image = tf.image.resize(coarse, [height, width], "bicubic")[0]
        image += rng.normal(0, 12, (height, width, 3))
        data = tf.io.encode_jpeg(tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8), quality=90)
        folder = os.path.join(root, f"class{i % 4}")
        os.makedirs(folder, exist_ok=True)
        tf.io.write_file(os.path.join(folder, f"{i:06d}.JPEG"), data)


def rate(dataset: tf.data.Dataset, batches: int) -> float:
    """Images/s a dataset of batches delivers, after a warm-up of 3 batches."""
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH / (time.perf_counter() - start)


def in_sequence(data_dir: str, per_image) -> tf.data.Dataset:
    """The training shards read in sequence, ``per_image(jpeg bytes, seed)`` in parallel."""
    paths = tf.io.gfile.glob(os.path.join(data_dir, "train-*.tfrecord"))
    feature = {"image": tf.io.FixedLenFeature([], tf.string)}
    records = tf.data.TFRecordDataset(paths).repeat()
    seeds = tf.data.Dataset.random(seed=0).batch(2)
    dataset = tf.data.Dataset.zip((records, seeds)).map(
        lambda record, seed: per_image(tf.io.parse_single_example(record, feature)["image"], seed),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    return dataset.batch(BATCH).prefetch(tf.data.AUTOTUNE)


def decoded(data: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    del seed
    return tf.io.decode_jpeg(data, channels=3)[:1, :1]  # whole decode; a tiny result to batch


def naive(data: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Decode all, then the random-resized crop, resize and flip."""
    image = tf.io.decode_jpeg(data, channels=3)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=seed,
        min_object_covered=0.1,
        aspect_ratio_range=images.ASPECT,
        area_range=images.AREA,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = tf.image.resize(tf.slice(image, begin, size), SIZE)
    return tf.image.stateless_random_flip_left_right(image, seed + 1) / 255.0


def fused_in_memory(data_dir: str) -> tf.data.Dataset:
    """The framework's own crop (the window decoded) on JPEG bytes held in memory, in order.

    What the framework's pipeline does per image, without its reading by index: the
    difference between the two is what reading by index costs.
    """
    paths = tf.io.gfile.glob(os.path.join(data_dir, "train-*.tfrecord"))
    feature = {"image": tf.io.FixedLenFeature([], tf.string)}
    records = tf.data.TFRecordDataset(paths).map(
        lambda record: tf.io.parse_single_example(record, feature)["image"]
    )
    jpegs = tf.constant(list(records.as_numpy_iterator()))
    seeds = tf.data.Dataset.random(seed=0).batch(2)
    dataset = tf.data.Dataset.zip((tf.data.Dataset.from_tensor_slices(jpegs).repeat(), seeds))
    dataset = dataset.map(
        lambda data, seed: images.random_resized_crop(data, seed, SIZE, 3),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    return dataset.batch(BATCH).prefetch(tf.data.AUTOTUNE)


def framework(data_dir: str, in_memory: bool = False) -> tf.data.Dataset:
    """``tfrecord.input_fn``'s training batches: by index from the shards, or held in memory."""
    params = InputParams(batch_size=BATCH, global_batch_size=BATCH, seed=0)
    # From the files, as at ImageNet's size; or the records held in memory.
    gin.bind_parameter("pipeline.cache", in_memory)
    try:
        return tfrecord.input_fn(
            Mode.TRAIN, params, data_dir=data_dir, image_size=SIZE[0], augment="inception"
        ).map(lambda features, labels: features["image"])
    finally:
        gin.clear_config()


def images_per_gpu() -> dict[str, float]:
    """Images/s one GPU trains the ImageNet AlexNet at, in costs.py's model."""
    from benchmarks import costs

    alexnet = costs.networks()[0]
    return {gpu: peak * costs.UTILIZATION / alexnet.train_flops for gpu, peak in costs.GPUS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.set_verbosity(logging.ERROR)
    cores = os.cpu_count() or 1
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as root:
        generate(os.path.join(root, "jpeg"), args.images)
        original, small = os.path.join(root, "original"), os.path.join(root, "max_side_320")
        folders.prepare(os.path.join(root, "jpeg"), original, 4, eval_fraction=0.05)
        folders.prepare(os.path.join(root, "jpeg"), small, 4, eval_fraction=0.05, max_side=320)
        for name, data_dir in (("original", original), ("max_side_320", small)):
            train = shards.read_metadata(data_dir)["splits"]["train"]
            total = sum(shard["bytes"] for shard in train["shards"])
            results[f"{name}_bytes_per_image"] = total / train["count"]
        results["decode_only"] = rate(in_sequence(original, decoded), args.batches)
        results["naive"] = rate(in_sequence(original, naive), args.batches)
        results["fused_in_memory"] = rate(fused_in_memory(original), args.batches)
        results["framework_in_memory"] = rate(framework(original, True), args.batches)
        results["framework"] = rate(framework(original), args.batches)
        results["framework_max_side_320"] = rate(framework(small), args.batches)
    header = f"{'ImageNet-style input, 224x224, batch 128':<52}{'img/s':>9}"
    print(f"{header}{'per core':>10}{'/ naive':>9}")
    for key, label in [
        ("decode_only", "decode alone (whole JPEG, in sequence)"),
        ("naive", "naive: decode all, crop, resize, flip"),
        ("fused_in_memory", "crop window decoded, JPEG bytes in memory"),
        ("framework_in_memory", "framework: by index, records held in memory"),
        ("framework", "framework: by index, crop window decoded"),
        ("framework_max_side_320", "framework on --max_side 320 storage"),
    ]:
        value = results[key]
        ratio = value / results["naive"]
        results[f"ratio_{key}_vs_naive"] = ratio
        print(f"{label:<52}{value:>9.0f}{value / cores:>10.0f}{ratio:>8.2f}x")
    print(
        f"bytes per image: {results['original_bytes_per_image']:,.0f} as found, "
        f"{results['max_side_320_bytes_per_image']:,.0f} with --max_side 320"
    )
    best = results["framework_max_side_320"] / cores
    for gpu, consumed in images_per_gpu().items():
        results[f"cores_per_{gpu}"] = consumed / best
        print(
            f"{gpu} training the ImageNet AlexNet (costs.py: 40% of bf16 peak): "
            f"{consumed:,.0f} img/s = {consumed / best:.0f} such cores per GPU"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
