"""How fast the TFRecord pipeline delivers CIFAR-shaped batches vs how fast AlexNet eats them.

    python benchmarks/input_pipeline.py [--examples 10000] [--json out.json]

In one process: writes synthetic 32x32x3 images as TFRecord shards (PNG and raw),
times the training pipeline (interleave, shuffle, batch 128, vectorised parse,
random crop and flip) alone, then times the framework's AlexNet training step (the
cifar10_alexnet.gin model) on in-memory batches. The ratio says how much headroom the
input side has: >= 5 means the step, not the input, sets the pace.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from datasets import tfrecord  # noqa: E402
from models.alexnet import AlexNet  # noqa: E402
from trainer import Estimator, InputParams, Mode  # noqa: E402

BATCH = 128


def pipeline_rate(data_dir: str, batches: int) -> float:
    """Examples/s the augmented training pipeline delivers, after a warm-up."""
    params = InputParams(batch_size=BATCH, global_batch_size=BATCH, seed=0)
    iterator = iter(tfrecord.read(data_dir, "train", Mode.TRAIN, params, augment=True))
    for _ in range(20):  # warm-up: fill the shuffle buffer and the cache
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH / (time.perf_counter() - start)


def training_rate(steps: int) -> float:
    """Examples/s of Estimator.train on the cifar10_alexnet model, data in memory."""
    rng = np.random.default_rng(0)
    images = tf.constant(rng.random((BATCH, 32, 32, 3), np.float32))
    labels = tf.constant(rng.integers(0, 10, BATCH))

    def input_fn(mode, params):
        del mode, params
        return tf.data.Dataset.from_tensors(({"image": images}, {"label": labels})).repeat()

    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            AlexNet(num_classes=10, batch_norm=True, l2=5e-4),
            model_dir,
            global_batch_size=BATCH,
            steps_per_loop=10,
            log_every_steps=10,
            save_checkpoints_steps=None,
            optimizer=keras.optimizers.SGD(0.01),
        )
        estimator.train(input_fn, 10)  # warm-up: trace and compile
        start = time.perf_counter()
        estimator.train(input_fn, 10 + steps)
        return steps * BATCH / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)

    rng = np.random.default_rng(0)
    examples = [
        {"image": rng.integers(0, 256, (32, 32, 3), np.uint8), "label": i % 10}
        for i in range(args.examples)
    ]
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for image_format in ("raw", "png"):
            out = os.path.join(root, image_format)
            tfrecord.write(examples, out, "train", 8, image_format, num_classes=10)
            results[f"pipeline_{image_format}"] = pipeline_rate(out, args.batches)
    results["alexnet_train_step"] = training_rate(args.steps)
    for image_format in ("raw", "png"):
        results[f"ratio_{image_format}"] = (
            results[f"pipeline_{image_format}"] / results["alexnet_train_step"]
        )

    print(f"{'measurement':<34}{'examples/s':>12}")
    print(f"{'TFRecord pipeline, raw images':<34}{results['pipeline_raw']:>12.0f}")
    print(f"{'TFRecord pipeline, PNG images':<34}{results['pipeline_png']:>12.0f}")
    print(f"{'AlexNet training step (consumer)':<34}{results['alexnet_train_step']:>12.0f}")
    print(
        f"pipeline / step: raw {results['ratio_raw']:.1f}x, png {results['ratio_png']:.1f}x "
        f"(target >= 5x)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
