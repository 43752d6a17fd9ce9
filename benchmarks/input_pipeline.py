"""The input side at CIFAR shape: speed of each path, what a checkpoint holds, resume cost.

    python benchmarks/input_pipeline.py [--examples 10000] [--json out.json]

In one process (the CPU split into 2 logical devices, for the strategy rows):

1. Examples/s of the training pipelines on synthetic 32x32x3 images, batch 128:
   TFRecord shards (raw and PNG, random crop and flip) read by index (the default)
   and in sequence with a shuffle buffer (the pre-index path, ``by_index=False``);
   in-memory arrays read by index and through the pre-index cache + shuffle buffer;
   a TFDS dataset (PNG images, as TFDS stores them) prepared as ArrayRecord and read
   by index from its files, and prepared as TFRecord and read in sequence.
   Then the framework's AlexNet training step (cifar10_alexnet.gin's model) on
   in-memory batches: pipeline / step >= 5 means the step, not the input, sets the pace.
2. Bytes of input state in a checkpoint after 3 steps, default knobs: in-memory arrays
   of 2,000, 20,000 and 200,000 examples, a TFDS image dataset (mock cifar10), the
   ArrayRecord TFDS dataset above read from its files, shards.
3. Seconds to the first batch when resuming at step 0 and at step 20,000, on one
   device and under MirroredStrategy on 2 devices; and, for contrast, under the strategy
   with the pre-index path, which replays the skipped batches (at step 2,000 only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from trainer.distributed import strategies

strategies.split_cpu(2)

import gin  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import synthetic  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
from absl import logging  # noqa: E402

from datasets import batching, pipeline, tfds_images  # noqa: E402
from datasets.records import shards, tfrecord  # noqa: E402
from models.alexnet import AlexNet  # noqa: E402
from trainer import Estimator, InputParams, Mode, ModelFn, Spec  # noqa: E402
from trainer.settings import Checkpoints, Devices  # noqa: E402

BATCH = 128


def rate(dataset: tf.data.Dataset, batches: int) -> float:
    """Examples/s a training dataset delivers, after a warm-up."""
    iterator = iter(dataset)
    for _ in range(20):  # warm-up: fill buffers and caches
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH / (time.perf_counter() - start)


def params(**kwargs) -> InputParams:
    return InputParams(batch_size=BATCH, global_batch_size=BATCH, seed=0, **kwargs)


def training_rate(steps: int) -> float:
    """Examples/s of Estimator.train on the cifar10_alexnet model, data in memory."""
    rng = np.random.default_rng(0)
    images = tf.constant(rng.random((BATCH, 32, 32, 3), np.float32))
    labels = tf.constant(rng.integers(0, 10, BATCH))

    input_fn = synthetic.input_fn(images, labels)

    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            AlexNet(num_classes=10, batch_norm=True, l2=5e-4),
            model_dir,
            global_batch_size=BATCH,
            progress=False,
            steps_per_loop=10,
            log_every_steps=10,
            checkpoints=Checkpoints(every_steps=None),
            optimizer=keras.optimizers.SGD(0.01),
        )
        estimator.train(input_fn, 10)  # warm-up: trace and compile
        start = time.perf_counter()
        estimator.train(input_fn, 10 + steps)
        return steps * BATCH / (time.perf_counter() - start)


class Tiny(ModelFn):
    """A linear classifier over each image's channel means: 40 weights."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(10)

    def __call__(self, features, labels, mode):
        logits = self.dense(tf.reduce_mean(features["image"], axis=[1, 2]))
        if labels is None:
            return Spec({"logits": logits})
        loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels["label"], logits)
        return Spec({"logits": logits}, loss=tf.reduce_mean(loss))


def input_state_bytes(input_fn, model_dir: str) -> int:
    """Bytes of input state in the checkpoint of a 3-step run (all but model and counters)."""
    Estimator(Tiny(), model_dir, global_batch_size=BATCH, seed=0, progress=False).train(input_fn, 3)
    path = tf.train.latest_checkpoint(model_dir)
    reader = tf.train.load_checkpoint(path)
    state = ("model/", "optimizer/", "rng/", "step/", "save_counter/", "_CHECKPOINTABLE_OBJECT")
    return sum(
        np.asarray(reader.get_tensor(key)).nbytes
        for key, _ in tf.train.list_variables(path)
        if not key.startswith(state)
    )


def cifar_arrays(count: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (count, 32, 32, 3), np.uint8),
        "label": (np.arange(count) % 10).astype(np.int64),
    }


class CifarShaped(tfds.core.GeneratorBasedBuilder):
    """A TFDS dataset of ``EXAMPLES`` random 32x32x3 images (PNG-encoded, as TFDS stores them)."""

    VERSION = tfds.core.Version("1.0.0")
    EXAMPLES = 10_000

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(32, 32, 3)),
                    "label": tfds.features.ClassLabel(num_classes=10),
                }
            ),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        examples = cifar_arrays(self.EXAMPLES)
        for i, (image, label) in enumerate(zip(examples["image"], examples["label"], strict=True)):
            yield i, {"image": image, "label": int(label)}


@contextlib.contextmanager
def never_in_memory():
    """pipeline.cache = False while inside: sources are read from their files."""
    gin.bind_parameter("pipeline.cache", False)
    try:
        yield
    finally:
        gin.clear_config()


def tfds_rate(data_dir: str, batches: int) -> float:
    """Examples/s of tfds_images.input_fn on cifar_shaped in data_dir, read from files."""
    with never_in_memory():
        dataset = tfds_images.input_fn(
            Mode.TRAIN, params(), name="cifar_shaped", data_dir=data_dir, augment=True
        )
        return rate(dataset, batches)


def first_batch_seconds(estimator: Estimator, input_fn, step: int) -> float:
    """Seconds from building the training input at ``step`` to its first batch."""
    estimator.inputs.position.assign(step * BATCH)
    start = time.perf_counter()
    iterator = estimator.inputs.train_iterator(input_fn, step)
    next(iterator)
    return time.perf_counter() - start


KNOBS = dict(cache=True, shuffle_buffer=10_000, deterministic=True)  # the pre-index path's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.set_verbosity(logging.ERROR)
    examples = cifar_arrays(args.examples)
    with tempfile.TemporaryDirectory() as root:
        results = speeds(root, examples, args.batches, args.steps)
        results.update(input_states(root))
        results.update(resume_costs(root, examples))
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _sequential(examples, mode, p):
    """The pre-index pipeline over ``examples``, for comparison."""
    return pipeline._sequential(  # noqa: SLF001 - the pre-index path, for comparison
        [tf.data.Dataset.from_tensor_slices(examples)],
        mode,
        p,
        tfds_images.preprocess,
        None,
        None,
        "old",
        batching.Batching(KNOBS),
    )


def speeds(root: str, examples: dict, batches: int, steps: int) -> dict[str, float]:
    """1. Examples per second of each path, and of the AlexNet step that consumes them."""
    results = {}
    rows = [
        {"image": i, "label": int(y)}
        for i, y in zip(examples["image"], examples["label"], strict=True)
    ]
    for image_format in ("raw", "png"):
        out = os.path.join(root, image_format)
        shards.write(rows, out, "train", 8, image_format, num_classes=10)
        for by_index in (True, False):
            dataset = tfrecord.read(
                out, "train", Mode.TRAIN, params(), augment=True, by_index=by_index
            )
            name = f"tfrecord_{image_format}_{'index' if by_index else 'sequential'}"
            results[name] = rate(dataset, batches)
    source = pipeline.ArraySource(examples, "cifar-shaped")
    results["memory_index"] = rate(
        pipeline.build(source, Mode.TRAIN, params(), tfds_images.preprocess), batches
    )
    results["memory_sequential"] = rate(_sequential(examples, Mode.TRAIN, params()), batches)
    CifarShaped.EXAMPLES = len(examples["label"])
    for file_format in ("array_record", "tfrecord"):
        data_dir = os.path.join(root, f"tfds-{file_format}")
        CifarShaped(data_dir=data_dir, file_format=file_format).download_and_prepare()
        results[f"tfds_{file_format}"] = tfds_rate(data_dir, batches)
    results["alexnet_train_step"] = training_rate(steps)
    return results


def input_states(root: str) -> dict[str, float]:
    """2. Bytes of input state in a checkpoint, by source (``speeds`` wrote the files)."""
    results = {}
    for count in (2_000, 20_000, 200_000):
        big = pipeline.ArraySource(cifar_arrays(count), f"{count} examples")
        results[f"state_memory_{count}"] = input_state_bytes(
            lambda mode, p, s=big: pipeline.build(s, mode, p, tfds_images.preprocess),
            os.path.join(root, f"state-{count}"),
        )
    with tfds.testing.mock_data(num_examples=2_000):
        results["state_tfds_cifar10"] = input_state_bytes(
            lambda mode, p: tfds_images.input_fn(mode, p, name="cifar10", data_dir="unused"),
            os.path.join(root, "state-tfds"),
        )
    with never_in_memory():
        results["state_tfds_array_record"] = input_state_bytes(
            lambda mode, p: tfds_images.input_fn(
                mode, p, name="cifar_shaped", data_dir=os.path.join(root, "tfds-array_record")
            ),
            os.path.join(root, "state-tfds-array-record"),
        )
    results["state_tfrecord"] = input_state_bytes(
        lambda mode, p: tfrecord.read(os.path.join(root, "raw"), "train", mode, p),
        os.path.join(root, "state-tfrecord"),
    )
    return results


def resume_costs(root: str, examples: dict) -> dict[str, float]:
    """3. Seconds to the first batch when resuming at step 0 and at step 20,000."""
    source = pipeline.ArraySource(examples, "cifar-shaped")
    results = {}

    def index_fn(mode, p):
        return pipeline.build(source, mode, p, tfds_images.preprocess)

    for distribution, devices in (("towers", 1), ("mirrored", 2)):
        estimator = Estimator(
            Tiny(),
            os.path.join(root, distribution),
            global_batch_size=BATCH,
            progress=False,
            devices=Devices(distribution=distribution, count=devices),
            seed=0,
        )
        for step in (0, 20_000):
            first_batch_seconds(estimator, index_fn, step)  # warm-up
            results[f"resume_{distribution}_{step}"] = min(
                first_batch_seconds(estimator, index_fn, step) for _ in range(3)
            )
        if distribution == "mirrored":
            for step in (0, 2_000):
                results[f"resume_mirrored_sequential_{step}"] = first_batch_seconds(
                    estimator, lambda mode, p: _sequential(examples, mode, p), step
                )
    return results


def report(results: dict[str, float]) -> None:
    """Prints the three tables; adds the by-index / pre-index ratios to ``results``."""
    step_rate = results["alexnet_train_step"]
    print(f"{'pipeline (training, batch 128)':<44}{'examples/s':>12}{'/ step':>9}")
    for key, label in [
        ("tfrecord_raw_index", "TFRecord raw, by index"),
        ("tfrecord_raw_sequential", "TFRecord raw, in sequence (pre-index)"),
        ("tfrecord_png_index", "TFRecord PNG, by index"),
        ("tfrecord_png_sequential", "TFRecord PNG, in sequence (pre-index)"),
        ("memory_index", "in memory, by index"),
        ("memory_sequential", "in memory, cache + shuffle (pre-index)"),
        ("tfds_array_record", "TFDS ArrayRecord PNG, by index from files"),
        ("tfds_tfrecord", "TFDS TFRecord PNG, in sequence (pre-index)"),
        ("alexnet_train_step", "AlexNet training step (the consumer)"),
    ]:
        print(f"{label:<44}{results[key]:>12.0f}{results[key] / step_rate:>8.1f}x")
    results["tfds_index"] = results["tfds_array_record"]
    results["tfds_sequential"] = results["tfds_tfrecord"]
    for kind in ("tfrecord_raw", "tfrecord_png", "memory", "tfds"):
        ratio = results[f"{kind}_index"] / results[f"{kind}_sequential"]
        results[f"ratio_{kind}_index_vs_sequential"] = ratio
        print(f"{kind}: by index / pre-index {ratio:.2f}x (target >= 0.9x)")
    print(f"\n{'input state in a checkpoint':<44}{'bytes':>12}")
    for key in [k for k in results if k.startswith("state_")]:
        print(f"{key[len('state_') :]:<44}{results[key]:>12.0f}")
    print(f"\n{'seconds to the first batch when resuming':<44}{'step 0':>9}{'later':>9}")
    for name, label, later in [
        ("resume_towers", "one device, by index", 20_000),
        ("resume_mirrored", "mirrored on 2, by index", 20_000),
        ("resume_mirrored_sequential", "mirrored on 2, pre-index (replays)", 2_000),
    ]:
        first, then = results[f"{name}_0"], results[f"{name}_{later}"]
        print(f"{label:<44}{first:>9.3f}{then:>9.3f}  (at step {later}: {then / first:.2f}x)")


if __name__ == "__main__":
    main()
