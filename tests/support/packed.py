"""A per-token model trained on packed rows (``datasets/packing.py``): for
tests/test_packing.py and the parity harness's recipe rows.

96 examples of 1 to 19 tokens, each token's successor its label, a global batch of 16
packed in rows of 24 positions; the model is the parity harness's per-token classifier
under ``trainer.token_mean``.
"""

from __future__ import annotations

import gin
import keras
import numpy as np
import tensorflow as tf

import trainer
from datasets import pipeline
from tests.support import parity
from trainer import Mode
from trainer.settings import Checkpoints

COUNT, GLOBAL, LENGTH = 96, 16, 24  # 96 examples: 6 steps an epoch


class TokensOf(parity.TokenMeanOf):
    """The per-token model of ``features['tokens']``: packed or padded, its logits are
    the same for each token, so a token mean over the same examples is the same."""

    def __call__(self, features, labels, mode):
        tokens = features["tokens"]
        logits = self.model(tokens, training=mode == Mode.TRAIN)
        if labels is None:
            return trainer.Spec({"logits": logits})
        losses = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        return trainer.Spec({"logits": logits}, loss=trainer.token_mean(losses, tokens != 0))


def input_fn(seed: int = 1):
    """The examples' input_fn: ``pipeline.build`` over them, packed as gin binds it."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 20, COUNT)
    tokens = tf.ragged.constant([rng.integers(1, 8, n).tolist() for n in lengths], tf.int64)
    data = pipeline.ArraySource({"tokens": tokens}, "text")

    def fn(mode, params):
        def successors(example):  # each token's successor as its label
            return {"tokens": example["tokens"]}, example["tokens"] % 7 + 1

        return pipeline.build(data, mode, params, successors, name="text")

    return fn


def bind_budget():
    """The examples in batches by ``lengths.token_budget`` (4 to 16 a batch), grouped."""
    gin.bind_parameter("lengths.token_budget", 90)  # 11, 7 and 5 a batch: odd shares
    gin.bind_parameter("lengths.buckets", [4, 8, 12, 16, 20])
    gin.bind_parameter("lengths.group_batches", 2)


def trained(
    model_dir,
    steps: int,
    packed: bool = True,
    callbacks=(),
    model_fn=TokensOf,
    groups: dict | None = None,
    **settings,
) -> list:
    """The model's weights after ``steps`` steps of SGD on the examples, packed or
    padded, under Estimator ``settings`` (as ``parity.grouped`` takes them) and
    ``groups`` (``{'optimization': Optimization(...)}``), with gin's bindings as they
    are (packing's added)."""
    if packed:
        gin.bind_parameter("packing.length", LENGTH)
    try:
        model = parity.tokens()
        estimator = trainer.Estimator(
            model_fn(model),
            str(model_dir),
            optimizer=keras.optimizers.SGD(0.5),
            global_batch_size=GLOBAL,
            seed=0,
            steps_per_loop=steps,
            log_every_steps=steps,
            checkpoints=Checkpoints(every_steps=None),
            progress=False,
            **parity.grouped(settings),
            **(groups or {}),
        )
        estimator.train(input_fn(), steps, callbacks=list(callbacks))
    finally:
        gin.clear_config()
    return [w.numpy() for w in model.weights]
