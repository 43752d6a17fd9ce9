"""The embedded digits dataset: fixed split, real pixels, pipeline semantics."""

import numpy as np
import pytest
import tensorflow as tf

from datasets import digits
from trainer import InputParams, Mode


def params(batch_size=64, seed=0):
    return InputParams(batch_size=batch_size, global_batch_size=batch_size, seed=seed)


def test_split_is_fixed_disjoint_and_complete():
    splits = digits.split_indices()
    assert len(splits["train"]) == 1437 and len(splits["test"]) == 360
    assert set(splits["train"]).isdisjoint(splits["test"])
    assert set(splits["train"]) | set(splits["test"]) == set(range(1797))
    np.testing.assert_array_equal(digits.split_indices()["test"], splits["test"])


def test_examples_are_the_scikit_learn_digits(data_dir):
    from sklearn.datasets import load_digits

    source = load_digits()
    first = digits.split_indices()["test"][0]
    example = next(iter(digits.load("test", data_dir)))
    assert example["image"].shape == (8, 8, 1) and example["image"].dtype == tf.uint8
    assert int(example["label"]) == source.target[first]
    np.testing.assert_allclose(
        example["image"].numpy()[..., 0] / 255 * 16, source.images[first], atol=0.04
    )


def test_eval_keeps_every_example_and_scales_pixels(data_dir):
    batches = list(digits.input_fn(Mode.EVAL, params(100), data_dir=data_dir))
    assert [len(y["label"]) for _, y in batches] == [100, 100, 100, 60]
    images = np.concatenate([f["image"].numpy() for f, _ in batches])
    assert images.min() == 0.0 and images.max() == 1.0
    labels = np.concatenate([y["label"].numpy() for _, y in batches])
    assert set(labels) == set(range(10))


def first_labels(data_dir, seed, batches=3):
    dataset = digits.input_fn(Mode.TRAIN, params(32, seed), data_dir=data_dir)
    return np.concatenate([y["label"].numpy() for _, y in dataset.take(batches)])


def test_training_order_follows_the_seed(data_dir):
    np.testing.assert_array_equal(first_labels(data_dir, 0), first_labels(data_dir, 0))
    assert not np.array_equal(first_labels(data_dir, 0), first_labels(data_dir, 1))


def test_training_repeats_with_full_batches(data_dir):
    dataset = digits.input_fn(Mode.TRAIN, params(100), data_dir=data_dir)
    sizes = [len(y["label"]) for _, y in dataset.take(30)]  # 3000 > 1437 examples
    assert sizes == [100] * 30


@pytest.mark.parametrize("split", ["train", "test"])
def test_train_split_option(data_dir, split):
    dataset = digits.input_fn(Mode.EVAL, params(2000), data_dir=data_dir, split=split)
    ((_, labels),) = list(dataset)
    assert len(labels["label"]) == len(digits.split_indices()[split])
