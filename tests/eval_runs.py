"""Evaluates one digits MLP checkpoint under a device set-up; prints JSON.

Run by tests/test_parallel.py and tests/test_workers.py as a subprocess, because
logical CPU devices must be set up before TensorFlow starts:

    python tests/eval_runs.py MODEL_DIR DATA_DIR DISTRIBUTION:DEVICES [TRAIN_STEPS]

With TRAIN_STEPS it first trains that many steps (on one device: the checkpoint the
other set-ups evaluate). Under ``multi_worker:1`` each worker runs it with its
TF_CONFIG. Prints the eval metrics, and how many examples each local replica
evaluated. The eval batch, 50, splits unevenly over 4 replicas, and the eval set's
last batch holds 10 of the 360 examples.
"""

import json
import sys

from trainer import parallel

SETUP = sys.argv[3].partition(":")
parallel.split_cpu(4 if SETUP[0] != "multi_worker" else 1)
if SETUP[0] == "multi_worker":
    parallel.make_strategy("multi_worker", [])  # before any op runs

import keras  # noqa: E402
from absl import logging  # noqa: E402

import datasets.digits  # noqa: E402
from models.mlp import MLP  # noqa: E402
from trainer import Estimator  # noqa: E402


def main(model_dir: str, data_dir: str, train_steps: int) -> None:
    distribution, _, devices = SETUP
    keras.utils.set_random_seed(0)
    estimator = Estimator(
        MLP(num_classes=10, hidden_units=[32], dropout_rate=0.0),
        model_dir,
        global_batch_size=64,
        eval_batch_size=50,
        seed=0,
        write_graph=False,
        distribution=distribution,
        num_devices="auto" if distribution == "multi_worker" else int(devices),
        progress=False,
    )

    def input_fn(mode, params):
        return datasets.digits.input_fn(mode, params, data_dir=data_dir)

    if train_steps:
        estimator.train(input_fn, train_steps)
    metrics = estimator.evaluate(input_fn)
    sums = estimator.model.steps.eval_metrics
    strategy = estimator.placement.strategy
    counts = strategy.experimental_local_results(sums.count) if strategy else [sums.count]
    print(json.dumps({"metrics": metrics, "counts": [float(c.numpy()) for c in counts]}))


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    main(sys.argv[1], sys.argv[2], int(sys.argv[4]) if len(sys.argv) > 4 else 0)
