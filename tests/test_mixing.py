"""MixUp, CutMix and label smoothing: what they compute, and that they resume and shard exactly."""

from __future__ import annotations

import gin
import numpy as np
import pytest
import tensorflow as tf

from datasets import mixing, pipeline
from models import heads
from trainer import InputParams, Mode, UserError, errors

CLASSES = 10
COUNT = 64  # examples; each image holds its own id in every pixel, so mixes can be read back


def _source():
    ids = np.arange(COUNT, dtype=np.float32)
    images = np.broadcast_to(ids[:, None, None, None], (COUNT, 6, 6, 1)).copy()
    return pipeline.ArraySource({"image": images, "label": np.arange(COUNT) % CLASSES}, "ids")


def _preprocess(example):
    return {"image": example["image"]}, {"label": example["label"]}


def _flip(features, labels, seed):
    """A per-example augmentation: sends the pipeline down its example-by-example path."""
    image = tf.image.stateless_random_flip_left_right(features["image"], seed)
    return {**features, "image": image}, labels


def _global_batches(bindings, global_batch, pipelines, start=0, steps=3, augment=None):
    """Each step's global batch, put together from ``pipelines`` pipelines' shares."""
    with gin.unlock_config():
        gin.parse_config(bindings)
    try:
        shares = []
        for i in range(pipelines):
            params = InputParams(
                batch_size=global_batch // pipelines,
                global_batch_size=global_batch,
                seed=3,
                num_input_pipelines=pipelines,
                input_pipeline_id=i,
                start_example=start,
            )
            dataset = pipeline.build(_source(), Mode.TRAIN, params, _preprocess, augment=augment)
            shares.append(
                [(f["image"].numpy(), y["label"].numpy()) for f, y in dataset.take(steps)]
            )
    finally:
        gin.clear_config()
    return [
        tuple(np.concatenate([share[k][j] for share in shares]) for j in range(2))
        for k in range(steps)
    ]


BOTH = ["mixing.mixup_alpha = 0.4", "mixing.cutmix_alpha = 1.0", f"mixing.num_classes = {CLASSES}"]


@pytest.mark.slow
@pytest.mark.parametrize("augment", [None, _flip], ids=["whole_batches", "example_by_example"])
def test_pairs_mix_alike_on_one_or_two_pipelines_and_from_a_resumed_position(augment):
    """The same global batches whatever the sharding, and from the middle of the stream."""
    one = _global_batches(BOTH, 16, 1, augment=augment)
    two = _global_batches(BOTH, 16, 2, augment=augment)
    four = _global_batches(BOTH, 16, 4, augment=augment)
    resumed = _global_batches(BOTH, 16, 2, start=16, steps=2, augment=augment)
    for k in range(3):
        for j in range(2):
            np.testing.assert_array_equal(one[k][j], two[k][j])
            np.testing.assert_array_equal(one[k][j], four[k][j])
    for k in range(2):
        for j in range(2):
            np.testing.assert_array_equal(one[k + 1][j], resumed[k][j])
    plain = _global_batches([], 16, 1, augment=augment)
    assert not np.array_equal(one[0][0], plain[0][0])  # something was mixed


def test_cutmix_pastes_the_neighbours_box_and_the_label_is_the_share_of_pixels():
    """Each pixel is its own or its neighbour's; the label weighs them as the pixels do."""
    plain = _global_batches([], 32, 1, steps=2)
    cut = _global_batches(
        ["mixing.cutmix_alpha = 1.0", f"mixing.num_classes = {CLASSES}"], 32, 1, steps=2
    )
    boxes = 0
    for (ids, labels), (images, targets) in zip(plain, cut, strict=True):
        own, other = ids[:, 0, 0, 0], ids[np.arange(32) ^ 1, 0, 0, 0]
        pixels = images[..., 0].reshape(32, -1)
        assert np.all((pixels == own[:, None]) | (pixels == other[:, None]))
        kept = np.mean(pixels == own[:, None], axis=1)
        expected = np.zeros((32, CLASSES))
        expected[np.arange(32), labels] += kept
        expected[np.arange(32), labels[np.arange(32) ^ 1]] += 1 - kept
        np.testing.assert_allclose(targets, expected, atol=1e-6)
        np.testing.assert_allclose(kept, kept[np.arange(32) ^ 1])  # one box for the pair
        boxes += np.sum(kept < 1)
    assert boxes > 32  # most pairs were cut


def test_mixup_blends_neighbours_with_the_labels_weight_and_probability_leaves_some_alone():
    """image = lam * own + (1 - lam) * neighbour, label likewise; probability 0.5 spares some."""
    plain = _global_batches([], 32, 1, steps=2)
    bindings = [
        "mixing.mixup_alpha = 0.4",
        "mixing.probability = 0.5",
        f"mixing.num_classes = {CLASSES}",
    ]
    mixed = _global_batches(bindings, 32, 1, steps=2)
    untouched = 0
    for (ids, labels), (images, targets) in zip(plain, mixed, strict=True):
        own, other = ids[:, 0, 0, 0], ids[np.arange(32) ^ 1, 0, 0, 0]
        lam = targets[np.arange(32), labels]
        same = labels == labels[np.arange(32) ^ 1]
        lam = np.where(same, np.nan, lam)
        blended = images[:, 0, 0, 0]
        ok = np.isnan(lam) | np.isclose(blended, lam * own + (1 - lam) * other, atol=1e-4)
        assert ok.all()
        assert np.allclose(images, images[:, :1, :1, :])  # blended whole, no box
        np.testing.assert_allclose(targets.sum(axis=1), 1.0, atol=1e-6)
        untouched += np.sum(blended == own)
    assert 8 <= untouched <= 56  # about half the pairs left alone


def test_an_odd_replica_batch_and_a_missing_class_count_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"batch of 7 is odd: make Estimator.global_batch_size"):
        _global_batches(BOTH, 14, 2)
    with pytest.raises(UserError, match=r"bind mixing.num_classes"):
        _global_batches(["mixing.cutmix_alpha = 1.0"], 16, 1)
    with pytest.raises(UserError, match=r"mixing.probability must be in \[0, 1\], got 2"):
        mixing.Mixing(mixup_alpha=0.2, probability=2, num_classes=3)


def test_the_head_takes_mixed_labels_and_smooths_as_keras_does():
    """Soft labels and smoothing give Keras's categorical cross-entropy; accuracy by argmax."""
    rng = np.random.default_rng(0)
    logits = tf.constant(rng.normal(size=(8, 5)), tf.float32)
    ids = np.array([0, 1, 2, 3, 4, 0, 1, 2])
    soft = np.eye(5)[ids] * 0.7 + np.eye(5)[(ids + 1) % 5] * 0.3
    spec = heads.classification(
        logits, {"label": tf.constant(soft, tf.float32)}, label_smoothing=0.1
    )
    keras_loss = tf.keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    np.testing.assert_allclose(spec.loss, keras_loss(soft, logits), rtol=1e-6)
    np.testing.assert_array_equal(spec.metrics["accuracy"], np.argmax(logits, 1) == ids)
    smoothed = heads.classification(logits, {"label": tf.constant(ids)}, label_smoothing=0.1)
    np.testing.assert_allclose(smoothed.loss, keras_loss(np.eye(5)[ids], logits), rtol=1e-6)
    plain = heads.classification(logits, {"label": tf.constant(ids)})
    sparse = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    np.testing.assert_allclose(plain.loss, sparse(ids, logits), rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not a distribution"):
        heads.classification(logits, {"label": tf.constant(soft * 2, tf.float32)})
    with pytest.raises(UserError, match=r"over 4 classes where the model has 5: is mixing"):
        heads.classification(logits, {"label": tf.constant(soft[:, :4], tf.float32)})


def _batches(source, bindings, steps=1):
    with gin.unlock_config():
        gin.parse_config(bindings)
    params = InputParams(batch_size=16, global_batch_size=16, seed=3)
    dataset = pipeline.build(source, Mode.TRAIN, params, _preprocess)
    return [y["label"].numpy() for _, y in dataset.take(steps)]


def test_labels_that_cannot_be_mixed_and_data_that_is_no_image_are_refused_in_one_line():
    """Class ids out of range made rows of zeros that a Keras loss took silently; one-hot
    labels and a non-image feature ended in tracebacks."""
    images = np.zeros((COUNT, 6, 6, 1), np.float32)
    shifted = pipeline.ArraySource({"image": images, "label": np.arange(COUNT) % 10 + 1}, "ids")
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        _batches(shifted, BOTH)
    assert "label out of range [0, 10) in MixUp/CutMix; is mixing.num_classes right?" in str(
        raised.value
    )
    one_hot = np.eye(CLASSES, dtype=np.float32)[np.arange(COUNT) % CLASSES]
    with pytest.raises(UserError) as refused:
        _batches(pipeline.ArraySource({"image": images, "label": one_hot}, "one_hot"), BOTH)
    assert errors.first_line(refused.value).startswith(  # the command line's line
        "MixUp and CutMix make class distributions of class ids, one per example, but label "
        "'label' is float32 of shape (16, 10): give class ids (not one-hot rows)"
    )
    rows = pipeline.ArraySource(
        {"image": np.zeros((COUNT, 10), np.float32), "label": np.arange(COUNT) % CLASSES}, "rows"
    )
    with pytest.raises(UserError) as refused:
        _batches(rows, BOTH)
    assert errors.first_line(refused.value).startswith(
        "MixUp and CutMix mix images [batch, height, width, channels], but 'image' is of "
        "shape (16, 10)"
    )
