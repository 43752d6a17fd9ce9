"""Writes a dataset as sharded TFRecord files, or verifies a written directory.

    python3 -m datasets.prepare --dataset digits --out data/digits --shards 4
    python3 -m datasets.prepare --dataset mnist --data_dir ~/tensorflow_datasets
        --out data/mnist --shards 16 --format raw --compression GZIP   (one line)
    python3 -m datasets.prepare --verify data/digits

``--dataset`` is 'digits' (built offline from scikit-learn) or any TFDS image
dataset already present in ``--data_dir`` (nothing downloads here). Train with
``tfrecord.input_fn.data_dir = 'data/digits'``.
"""

from __future__ import annotations

import sys

import tensorflow_datasets as tfds
from absl import app, flags

from trainer import UserError, errors, logs

flags.DEFINE_string("dataset", None, "'digits', or a TFDS image dataset present in --data_dir.")
flags.DEFINE_string("out", None, "Directory to write the shards and dataset.json to.")
flags.DEFINE_integer("shards", 4, "Shards per split.")
flags.DEFINE_enum("format", "png", ["png", "raw"], "How images are stored.")
flags.DEFINE_enum("compression", "none", ["none", "GZIP"], "Record compression.")
flags.DEFINE_list("splits", ["train", "test"], "Splits to write.")
flags.DEFINE_string("data_dir", None, "TFDS data_dir of the source dataset.")
flags.DEFINE_string("verify", None, "Instead of writing, read every record under this dir.")
FLAGS = flags.FLAGS


def examples(dataset: str, split: str, data_dir: str | None):
    """``(list of {'image', 'label'} numpy examples, num_classes)`` of a source split."""
    if dataset == "digits":
        from datasets import digits

        source, num_classes = digits.load(split, data_dir), digits.NUM_CLASSES
    else:
        from datasets import tfds_images

        source = tfds_images.load(dataset, split, data_dir, download=False)
        num_classes = tfds.builder(dataset, data_dir=data_dir).info.features["label"].num_classes
    return list(tfds.as_numpy(source)), num_classes


def main(argv: list[str]) -> None:
    """Writes or verifies; one line and exit 2 on bad input."""
    del argv
    from datasets import tfrecord

    logs.use_console()  # its own lines, plainly; TFDS's INFO lines stay off

    try:
        if FLAGS.verify:
            metadata = tfrecord._read_metadata(FLAGS.verify)  # noqa: SLF001
            problems = [
                p for split in metadata["splits"] for p in tfrecord.verify(FLAGS.verify, split)
            ]
            for problem in problems:
                print(problem)
            print(f"{FLAGS.verify}: {'damaged' if problems else 'all records readable'}")
            sys.exit(1 if problems else 0)
        if not FLAGS.dataset or not FLAGS.out:
            raise UserError("--dataset and --out are required (or --verify DIR)")
        compression = None if FLAGS.compression == "none" else FLAGS.compression
        for split in FLAGS.splits:
            rows, num_classes = examples(FLAGS.dataset, split, FLAGS.data_dir)
            entry = tfrecord.write(
                rows, FLAGS.out, split, FLAGS.shards, FLAGS.format, compression, num_classes
            )
            print(f"{split}: {entry['count']} examples in {len(entry['shards'])} shards")
        print(f"wrote {FLAGS.out}")
    except UserError as error:
        print(f"error: {errors.first_line(error)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
