"""A tiny keras-hub BERT classifier, its sentences and input_fn (tests/test_keras_hub.py),
keras-hub's own fit of it (``fitted``), and its run on two mirrored replicas in a
subprocess (``mirrored_apart``)."""

import keras
import keras_hub
import numpy as np
import tensorflow as tf

import trainer
from tests.support.parity import AdamOfDenseGradients

WORDS = "the a cat dog bird sat ran flew on over mat wall fast slow big small red blue".split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
ANIMALS = {"cat", "dog", "bird"}
BATCH, STEPS, LENGTH, WIDTH = 4, 3, 12, 32


def sentences(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Raw strings and labels, as keras-hub's guides give them to fit: does it name an animal?"""
    rng = np.random.default_rng(seed)
    x = [" ".join(rng.choice(WORDS, size=rng.integers(2, 10))) for _ in range(count)]
    y = [int(bool(ANIMALS & set(s.split()))) for s in x]
    return np.array(x), np.array(y)


def preprocessor(sequence_length: int = LENGTH):
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCAB)
    return keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length)


def classifier() -> keras_hub.models.BertTextClassifier:
    """The same tiny classifier each call (seeded), compiled as keras-hub compiles it."""
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(VOCAB),
        num_layers=2,
        num_heads=2,
        hidden_dim=WIDTH,
        intermediate_dim=2 * WIDTH,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=preprocessor(), dropout=0.0
    )


def input_fn_of(x, y):
    """README's input_fn: the training stream repeats, the others pass once."""

    def input_fn(mode, params):
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        if mode == trainer.Mode.TRAIN:
            dataset = dataset.repeat()
        return dataset.batch(params.batch_size)

    return input_fn


def estimator(model, model_dir) -> trainer.Estimator:
    return trainer.Estimator(
        model, str(model_dir), global_batch_size=BATCH, steps_per_loop=1, progress=False
    )


def fitted(x, y, optimizer=None):
    """keras-hub's own fit, on halves of ``(x, y)``: the weights after each."""
    model = classifier()
    if optimizer is not None:
        metrics = [keras.metrics.SparseCategoricalAccuracy()]  # as keras-hub compiles
        model.compile(optimizer=optimizer, loss=model.loss, metrics=metrics)
    after = []
    for part in np.split(np.arange(len(x)), 2):
        model.fit(x[part], y[part], batch_size=BATCH, shuffle=False, verbose=0)
        after.append([w.copy() for w in model.get_weights()])
    return model, after


def mirrored_apart(model_dir: str) -> float:
    """How far three steps of the classifier on two mirrored replicas (each pipeline's
    batches preprocessed apart) end from keras-hub's fit on one device, with Adam of the
    dense gradient. Towers take one device's path, as the parity grid shows."""
    x, y = sentences(2 * STEPS * BATCH, seed=1)
    _, (theirs, _) = fitted(x, y, AdamOfDenseGradients(learning_rate=5e-5))
    ours = classifier()
    trainer.Estimator(
        ours,
        model_dir,
        global_batch_size=BATCH,
        progress=False,
        devices=trainer.Devices("mirrored", 2),
    ).train(input_fn_of(x, y), max_steps=STEPS)
    pairs = zip(ours.get_weights(), theirs, strict=True)
    return max(float(np.abs(a - b).max()) for a, b in pairs)
