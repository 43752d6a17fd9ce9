"""The seed's sequence recipe (experiments/reverse_lstm.gin), small, trained in this
process as the command line trains it: for tests/test_seq2seq.py and the parity
harness's recipe row (trained on one device and compared under each column)."""

from __future__ import annotations

import gin
import keras
import tensorflow as tf

from models import seq2seq
from tests.support.commands import REPO
from tests.support.helpers import saved_state
from trainer import Mode
from trainer.cli import experiment

SMALL = [
    "reversal.input_fn.count = 2000",
    "reversal.input_fn.eval_count = 64",
    "Seq2Seq.width = 32",
    "Estimator.steps_per_loop = 5",
    "Checkpoints.every_steps = 20",
    "experiment.eval_every_steps = None",
]
NO_DROPOUT = "Seq2Seq.dropout = 0.0"


def trained(model_dir, steps: int, *bindings: str) -> dict:
    """The recipe, small, trained to ``steps`` in ``model_dir`` (resumed if it holds a
    checkpoint) with gin ``bindings``; the training state it saved last."""
    gin.clear_config()
    gin.parse_config_files_and_bindings(
        [f"{REPO}/experiments/reverse_lstm.gin"],
        [*SMALL, f"experiment.max_steps = {steps}", *bindings],
    )
    keras.utils.set_random_seed(0)  # as the command line does before gin makes the model
    try:
        experiment.experiment(model_dir=str(model_dir), schedule="train")
    finally:
        gin.clear_config()
    return saved_state(model_dir)


def weights(model_dir) -> dict:
    """The Seq2Seq weights of ``model_dir``'s newest checkpoint, by Keras path.

    Read through the checkpoint's object graph: TensorFlow saves a variable under its
    shortest path, the LSTMs' (four deep in the model) under the optimizer's list of
    them, whose order differs between runs that build it differently.
    """
    model = seq2seq.Seq2Seq(12, width=32)
    batch = (
        {"tokens": tf.constant([[3, 4]], tf.int64)},
        {"targets": tf.constant([[4, 3, 2]], tf.int64)},
    )
    model(*batch, Mode.TRAIN)
    latest = tf.train.latest_checkpoint(str(model_dir))
    tf.train.Checkpoint(model=model).read(latest).expect_partial()
    return {v.path: v.numpy() for v in model.trainable_variables}
