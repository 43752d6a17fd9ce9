"""Trains a model that records which examples each step saw; prints its table as JSON.

Run by tests/test_order.py as a subprocess, because logical CPU devices must be set up
before TensorFlow starts (and strategies of different sizes cannot share a process):

    python tests/support/resume_runs.py MODEL_DIR DISTRIBUTION:DEVICES MAX_STEPS[,...] [CLIP]

(several MAX_STEPS: train to each in turn, printing a table at each; CLIP: clip the
gradient's global norm to it; RESUME_RUNS_INPUT=own in the environment: the input_fn a
user writes from arrays instead of the framework's indexed one; RESUME_RUNS_INPUT=parquet
with RESUME_RUNS_PARQUET=FILE: the ids read by index from that Parquet file's ``id``
column, a window of 2 row groups at a time (``datasets/tables/``);
RESUME_RUNS_MICROBATCHES=k: each batch in k micro-batches). Under
``multi_worker:1`` each worker process runs it with its TF_CONFIG.

The model holds one weight per example id, its loss is the mean weight of the batch,
and plain SGD's learning rate at step t is t + 1: each id's final weight is
``-(sum of (t + 1) / global_batch over the steps t that read it)``. Every replica adds
the same float32 numbers in the same order, whatever the replica count (an id is read
by one replica in a step; the others add zeros), so two runs end with bit-equal
weights exactly when every step read the same examples.
"""

import json
import os
import sys

import lean_start  # noqa: F401 - TensorFlow loads as the command line loads it

from trainer.distributed import strategies

SETUP = sys.argv[2].partition(":")
strategies.split_cpu(4 if SETUP[0] != "multi_worker" else int(SETUP[2]))
if SETUP[0] == "multi_worker":
    strategies.make_strategy("multi_worker", [])  # before any op runs

import gin  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from datasets import pipeline  # noqa: E402
from datasets.tables import source as tables  # noqa: E402
from trainer import Estimator, ModelFn, Spec  # noqa: E402
from trainer.settings import Checkpoints, Devices, Optimization, Summaries  # noqa: E402

EXAMPLES = 50
GLOBAL_BATCH = 12  # divides over 1, 2, 3 and 4 replicas
MAX_STEPS = 40


class IdTable(ModelFn):
    """One weight per example id."""

    def __init__(self):
        super().__init__()
        self.table = keras.layers.Embedding(EXAMPLES, 1, embeddings_initializer="zeros")

    def __call__(self, features, labels, mode):
        value = self.table(features["id"])[:, 0]
        loss = None if labels is None else tf.reduce_mean(value)
        return Spec({"value": value}, loss=loss)


def input_fn(mode, params):
    ids = pipeline.ArraySource({"id": np.arange(EXAMPLES)}, "ids")
    return pipeline.build(ids, mode, params, lambda e: ({"id": e["id"]}, {"id": e["id"]}))


def own_input_fn(mode, params):
    """As README's user writes one: arrays, shuffled, batched; no word of the workers."""
    ids = np.arange(EXAMPLES)
    dataset = tf.data.Dataset.from_tensor_slices(({"id": ids}, {"id": ids}))
    return dataset.shuffle(EXAMPLES, seed=params.seed).repeat().batch(params.batch_size)


def parquet_input_fn(mode, params):
    """The ids read where they lie, by index: the file is larger than memory allows."""
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    rows = tables.rows_of(os.environ["RESUME_RUNS_PARQUET"], {"id": "integer"}, window=2)
    source = pipeline.RecordExamples(rows, lambda row: row, "ids")
    return pipeline.build(source, mode, params, lambda e: ({"id": e["id"]}, {"id": e["id"]}))


INPUT_FNS = {"indexed": input_fn, "own": own_input_fn, "parquet": parquet_input_fn}


def main(model_dir: str, stops: list[int]) -> None:
    distribution, _, devices = SETUP
    rates = keras.optimizers.schedules.PiecewiseConstantDecay(
        list(range(MAX_STEPS - 1)), [float(t + 1) for t in range(MAX_STEPS)]
    )
    estimator = Estimator(
        IdTable(),
        model_dir,
        optimizer=keras.optimizers.SGD(rates),
        global_batch_size=GLOBAL_BATCH,
        steps_per_loop=3,
        checkpoints=Checkpoints(every_steps=5),
        seed=0,
        summaries=Summaries(write_graph=False),
        devices=Devices(
            distribution=distribution,
            count="auto" if distribution == "multi_worker" else int(devices),
        ),
        optimization=Optimization(
            clip_gradient_norm=float(sys.argv[4]) if len(sys.argv) > 4 else None,
            microbatches=int(os.environ.get("RESUME_RUNS_MICROBATCHES", "1")),
        ),
    )
    for max_steps in stops:
        input_fn = INPUT_FNS[os.environ.get("RESUME_RUNS_INPUT", "indexed")]
        estimator.train(input_fn, max_steps)
        table = estimator.model_fn.table.embeddings.numpy()[:, 0].tolist()
        steps = estimator.model.steps  # None when there was nothing to train
        norm = None if steps is None else float(steps.gradient_norm.numpy())  # the last step's
        print(json.dumps({"step": estimator.step, "table": table, "gradient_norm": norm}))


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    main(sys.argv[1], [int(stop) for stop in sys.argv[3].split(",")])
