"""A tiny keras-hub BERT classifier, its sentences and input_fn (tests/test_keras_hub.py),
and its runs on two devices in a subprocess (``on_two_devices``)."""

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


def on_two_devices(model_dir: str) -> dict[str, float]:
    """Three steps of the classifier on two mirrored replicas (each pipeline's batches
    preprocessed apart): how far it ends from keras-hub's fit (with Adam of the dense
    gradient) on one device. Towers take one device's path, as the parity grid shows."""
    x, y = sentences(STEPS * BATCH, seed=1)
    theirs = classifier()
    theirs.compile(
        optimizer=AdamOfDenseGradients(learning_rate=5e-5),
        loss=theirs.loss,
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    theirs.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    apart = {}
    for kind in ("mirrored",):
        ours = classifier()
        trainer.Estimator(
            ours,
            f"{model_dir}/{kind}",
            global_batch_size=BATCH,
            progress=False,
            devices=trainer.Devices(kind, 2),
        ).train(input_fn_of(x, y), max_steps=STEPS)
        pairs = zip(ours.get_weights(), theirs.get_weights(), strict=True)
        apart[kind] = max(float(np.abs(a - b).max()) for a, b in pairs)
    return apart
