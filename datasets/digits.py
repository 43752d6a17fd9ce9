"""The embedded default dataset: scikit-learn's real handwritten digits.

1797 grey 8x8 images of the digits 0-9 (UCI "optdigits", shipped inside the
scikit-learn wheel, so nothing downloads). It is served as a TFDS dataset that is
built locally on first use (about a second) into ``data_dir``, and read back like
any other TFDS dataset.

Split, fixed and documented: the 1797 examples are permuted with
``numpy.random.RandomState(0)``; the first 1437 (80%) are ``train``, the other 360
``test``. Pixels (0..16 in the source) are stored as uint8 0..255, like MNIST, so the
same preprocessing (scale to [0, 1]) serves both.
"""

from __future__ import annotations

import fcntl
import functools
import os

import gin
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
from absl import logging

from datasets import pipeline
from datasets.records import tfrecord
from trainer import InputParams, Mode, console, errors

NUM_EXAMPLES = 1797
NUM_TRAIN = 1437
NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)


def split_indices() -> dict[str, np.ndarray]:
    """The example indices of each split (see the module docstring)."""
    order = np.random.RandomState(0).permutation(NUM_EXAMPLES)
    return {"train": order[:NUM_TRAIN], "test": order[NUM_TRAIN:]}


class Digits(tfds.core.GeneratorBasedBuilder):
    """TFDS builder over ``sklearn.datasets.load_digits``; needs no download."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "80/20 split of the 1797 digits, seed 0."}

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="scikit-learn's handwritten digits (UCI optdigits test set), 8x8.",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=IMAGE_SHAPE),
                    "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
                }
            ),
            supervised_keys=("image", "label"),
            disable_shuffling=True,  # records stay in the documented index order
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # the data is inside the scikit-learn package
        return {name: self._generate_examples(idx) for name, idx in split_indices().items()}

    def _generate_examples(self, indices):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
        # Keyed by position: record k of a split is example split_indices()[split][k].
        for position, i in enumerate(indices):
            yield position, {"image": images[i], "label": int(digits.target[i])}


def load(split: str, data_dir: str | None = None) -> tf.data.Dataset:
    """The examples of ``split`` ('train', 'test', or a slice like 'train[:50%]')."""
    builder = Digits(data_dir=data_dir)
    with console.hushed():
        prepared = builder.is_prepared()
    if not prepared:
        # Processes started together (a trainer and its evaluator) build it once.
        os.makedirs(builder.data_dir_root, exist_ok=True)
        with open(os.path.join(builder.data_dir_root, ".digits.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            builder = Digits(data_dir=data_dir)
            with console.hushed():
                prepared = builder.is_prepared()
            if not prepared:
                logging.info("Building the digits dataset in %s (once, offline)", builder.data_dir)
                tfds.disable_progress_bar()
                with console.hushed():
                    builder.download_and_prepare()
    with console.hushed():
        return builder.as_dataset(split=split, shuffle_files=False)


@functools.lru_cache(maxsize=16)
def source(split: str, data_dir: str | None = None) -> pipeline.ArraySource:
    """The examples of ``split`` held in memory (about 100 KB), read once per process."""
    with console.hushed(), errors.runtime_errors(f"reading digits {split!r}"):
        examples = tfds.as_numpy(load(split, data_dir).batch(NUM_EXAMPLES).get_single_element())
    return pipeline.ArraySource(examples, name=f"digits {split}")


@tf.autograph.experimental.do_not_convert
def preprocess(example: dict) -> tuple[dict, dict]:
    """Scales pixels to [0, 1]; returns ``({'image'}, {'label'})``."""
    return pipeline.image_features(example), {"label": example["label"]}


@gin.configurable
def input_fn(
    mode: Mode,
    params: InputParams,
    split: str | list[str] | None = None,
    weights: list[float] | None = None,
    data_dir: str | None = None,
) -> tf.data.Dataset:
    """Digits batches for ``mode``: 'train' split for TRAIN, 'test' otherwise.

    Yields ``(features, labels)``, two dicts of batched tensors (PREDICT too):

    - ``features['image']``: float32 ``[batch, 8, 8, 1]``, grey levels in [0, 1]
      (0 background, 1 ink);
    - ``labels['label']``: int64 ``[batch]``, the digit, 0..9.

    TRAIN batches are exactly ``params.batch_size`` and repeat forever; EVAL and
    PREDICT read the 360 test examples once, the last batch partial.

    Args:
      mode: the mode asked for.
      params: batch size and seed, from the framework.
      split: overrides the split: 'train' to evaluate on training data, a slice like
        'train[:50%]', or a list of splits mixed by ``weights`` in training.
      weights: mixing probabilities of a list of splits.
      data_dir: where the built dataset lives; TFDS's default when None.
    """
    split = split or ("train" if mode == Mode.TRAIN else "test")
    splits = split if isinstance(split, list) else [split]
    sources = [source(s, data_dir) for s in splits]
    dataset = pipeline.build(
        sources, mode, params, preprocess, weights=weights, name="+".join(splits)
    )
    return tfrecord.served_as_stored(dataset, IMAGE_SHAPE)
