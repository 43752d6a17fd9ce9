"""Digits with faults injected on purpose, to test how training survives them."""

import gin
import tensorflow as tf

from datasets import digits
from trainer import Mode


@gin.configurable
def faulty_digits(mode, params, fault=None, at_batch=0):
    """``digits.input_fn`` whose TRAIN batches go bad from batch ``at_batch`` on.

    Faults: 'label' (labels out of range), 'nan' (infinite pixels), 'nan_once'
    (the same in batch ``at_batch`` only), 'empty' (no data), 'shape' (4x4 images).
    The pipeline has the same structure with or without a fault, so a checkpointed
    input iterator restores into it.
    """
    dataset = digits.input_fn(mode, params)
    if mode != Mode.TRAIN:
        return dataset

    def inject(index, element):
        features, labels = element
        hit = tf.equal(index, at_batch) if fault == "nan_once" else index >= at_batch
        image = features["image"]
        if fault in ("nan", "nan_once"):
            image = tf.where(hit, image + float("inf"), image)  # inf survives ReLU
        elif fault == "shape":
            image = image[:, ::2, ::2, :]
        label = labels["label"]
        if fault == "label":
            label = tf.where(hit, label + 10, label)
        return {"image": image}, {"label": label}

    return dataset.enumerate().map(inject).take(0 if fault == "empty" else 2**62)
