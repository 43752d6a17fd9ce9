"""Digits with faults injected on purpose, to test how training survives them."""

import time

import gin
import keras
import tensorflow as tf

from datasets import digits
from trainer import Mode, ModelFn, Spec

CORRUPT = "input data is corrupt"  # what datasets.records.indexed.RecordSource checks say


@gin.configurable
def faulty_digits(mode, params, fault=None, at_batch=0):
    """``digits.input_fn`` whose TRAIN batches go bad from batch ``at_batch`` on.

    Faults: 'label' (labels out of range), 'float_label' (float32 labels, whole
    numbers), 'half_label' (float32 labels, 0.5 added), 'nan' (infinite pixels), 'nan_once'
    (the same in batch ``at_batch`` only), 'empty' (no data), 'shape' (4x4 images),
    'not_a_dataset' (a list of batches instead of a dataset), 'label_on_worker_1' ('label'
    in the input of worker 1 of a multi-worker run only), 'hang_on_worker_1' (worker 1's
    input_fn never returns, its process still answering), 'slow' (each batch read 50 ms
    late, as from a busy disk); and one of EVAL batches,
    'corrupt_eval' (each fails as a corrupt record read lazily does).
    The pipeline has the same structure with or without a fault, so a checkpointed
    input iterator restores into it.
    """
    if fault == "hang_on_worker_1" and mode == Mode.TRAIN and params.input_pipeline_id == 1:
        while True:  # as an input_fn waiting on a file server that never answers
            time.sleep(1)
    dataset = digits.input_fn(mode, params)
    if mode != Mode.TRAIN and fault == "corrupt_eval":  # as a shard read lazily would fail

        def corrupt(features, labels):
            where = "corrupted record at 4917 in test.tfrecord"
            with tf.control_dependencies([tf.debugging.Assert(False, [CORRUPT, where])]):
                return {"image": tf.identity(features["image"])}, labels

        return dataset.map(corrupt)
    if mode != Mode.TRAIN:
        return dataset
    if fault == "not_a_dataset":
        return list(dataset.take(2))

    def inject(index, element):
        features, labels = element
        hit = tf.equal(index, at_batch) if fault == "nan_once" else index >= at_batch
        image = features["image"]
        if fault in ("nan", "nan_once"):
            image = tf.where(hit, image + float("inf"), image)  # inf survives ReLU
        elif fault == "shape":
            image = image[:, ::2, ::2, :]
        elif fault == "slow":
            late = tf.py_function(lambda: time.sleep(0.05) or 0.0, [], tf.float32)
            image += tf.ensure_shape(late, [])
        label = labels["label"]
        if fault == "label" or fault == "label_on_worker_1" and params.input_pipeline_id == 1:
            label = tf.where(hit, label + 10, label)
        elif fault in ("float_label", "half_label"):  # float class ids, whole or not
            label = tf.cast(label, tf.float32) + tf.where(hit, 0.5, 0.0) * (fault == "half_label")
        return {"image": image}, {"label": label}

    return dataset.enumerate().map(inject).take(0 if fault == "empty" else 2**62)


@gin.configurable
class NoLoss(ModelFn):
    """A classifier that forgets to return its loss."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(10)

    def __call__(self, features, labels, mode):
        return Spec({"logits": self.dense(tf.reshape(features["image"], [-1, 64]))})


@gin.configurable
def tuple_digits(mode, params):
    """digits batches as ``(image, label)`` tensors instead of dicts."""
    return digits.input_fn(mode, params).map(
        lambda features, labels: (features["image"], labels["label"])
    )


@gin.configurable
def faulty_keras(fault):
    """A Keras model for digits with one mistake: 'inputs' (two inputs no feature is
    named like), 'loss' (categorical crossentropy on class ids), 'uncompiled' (no
    loss at all) or 'metric' (a metric name misspelt)."""
    if fault == "inputs":
        pixels, ink = keras.Input((8, 8, 1), name="pixels"), keras.Input((1,), name="ink")
        hidden = keras.layers.Concatenate()([keras.layers.Flatten()(pixels), ink])
        model = keras.Model([pixels, ink], keras.layers.Dense(10)(hidden), name="two_inputs")
    else:
        model = keras.Sequential(
            [keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)],
            name="faulty",
        )
    if fault != "uncompiled":
        model.compile(
            "adam",
            loss="categorical_crossentropy"
            if fault == "loss"
            else "sparse_categorical_crossentropy",
            metrics=["acuracy"] if fault == "metric" else ["accuracy"],
        )
    return model
