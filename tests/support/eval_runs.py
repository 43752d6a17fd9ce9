"""Evaluates one digits MLP checkpoint under a device set-up; prints JSON.

Run by tests/test_parallel.py and tests/test_workers.py as a subprocess, because
logical CPU devices must be set up before TensorFlow starts:

    python tests/support/eval_runs.py MODEL_DIR DATA_DIR DISTRIBUTION:DEVICES [TRAIN_STEPS]

With TRAIN_STEPS it first trains that many steps (on one device: the checkpoint the
other set-ups evaluate). Under ``multi_worker:1`` each worker runs it with its
TF_CONFIG. Prints the eval metrics, the per-class figures and a PR curve, and how
many examples each local replica evaluated. The eval batch, 50, splits unevenly
over 4 replicas, and the eval set's last batch holds 10 of the 360 examples.
Besides its per-example accuracy the model streams two Keras metrics of a binary
task (is the digit even?): AUC and precision; with TRAIN_STEPS the output also holds
scikit-learn's of the same predictions.
"""

import json
import sys

import lean_start  # noqa: F401 - TensorFlow loads as the command line loads it

from trainer.distributed import strategies

SETUP = sys.argv[3].partition(":")
strategies.split_cpu(4 if SETUP[0] != "multi_worker" else 1)
if SETUP[0] == "multi_worker":
    strategies.make_strategy("multi_worker", [])  # before any op runs

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402
from sklearn import metrics as sk  # noqa: E402

import datasets.digits  # noqa: E402
from models.mlp import MLP  # noqa: E402
from trainer import Estimator, InputParams, Mode  # noqa: E402
from trainer.settings import Devices, Summaries  # noqa: E402


class EvenOdd(MLP):
    """The digits MLP, also scored as a binary classifier of even digits."""

    def __init__(self):
        super().__init__(num_classes=10, hidden_units=[32], dropout_rate=0.0)
        self.auc = keras.metrics.AUC(name="even_auc")
        self.precision = keras.metrics.Precision(name="even_precision")

    def __call__(self, features, labels, mode):
        spec = super().__call__(features, labels, mode)
        spec.predictions["even"] = even_probability(spec.predictions["probabilities"])
        if labels is not None:
            even = tf.cast(labels["label"] % 2 == 0, tf.float32)
            spec.metrics["even_auc"] = (self.auc, even, spec.predictions["even"])
            spec.metrics["even_precision"] = (self.precision, even, spec.predictions["even"])
        return spec


def even_probability(probabilities):
    return tf.reduce_sum(probabilities[:, ::2], axis=-1)


def main(model_dir: str, data_dir: str, train_steps: int) -> None:
    distribution, _, devices = SETUP
    keras.utils.set_random_seed(0)
    estimator = Estimator(
        EvenOdd(),
        model_dir,
        global_batch_size=64,
        eval_batch_size=50,
        seed=0,
        summaries=Summaries(write_graph=False),
        devices=Devices(
            distribution=distribution,
            count="auto" if distribution == "multi_worker" else int(devices),
        ),
        progress=False,
    )

    def input_fn(mode, params):
        return datasets.digits.input_fn(mode, params, data_dir=data_dir)

    if train_steps:
        estimator.train(input_fn, train_steps)
    metrics = estimator.evaluate(input_fn)
    sums = estimator.model.steps.eval.metrics
    strategy = estimator.placement.strategy
    counts = strategy.experimental_local_results(sums.count) if strategy else [sums.count]
    result = {"metrics": metrics, "counts": [float(c.numpy()) for c in counts]}
    report = estimator.model.steps.eval.observers[0].counts.report()  # read on every worker
    result["classes"] = estimator.model.classes["eval"]  # precision, recall, the confusion matrix
    result["pr_curve_3"] = report.pr_curve(3).tolist()
    if train_steps:  # scikit-learn's scores of the framework's own predictions
        predicted = list(estimator.predict(input_fn))
        even = np.array([p["even"] for p in predicted])
        _, labels = next(iter(input_fn(Mode.EVAL, InputParams(360, 360))))
        truth = labels["label"].numpy() % 2 == 0
        result["sklearn"] = {
            "even_auc": sk.roc_auc_score(truth, even),
            "even_precision": sk.precision_score(truth, even > 0.5),
        }
        classes = np.array([p["classes"] for p in predicted])
        precision, recall, _, support = sk.precision_recall_fscore_support(
            labels["label"].numpy(), classes, labels=range(10), zero_division=np.nan
        )
        result["sklearn_classes"] = {
            "precision": [None if np.isnan(p) else p for p in precision.tolist()],
            "recall": recall.tolist(),
            "support": support.tolist(),
            "confusion_matrix": sk.confusion_matrix(labels["label"].numpy(), classes).tolist(),
        }
        probability_3 = np.array([p["probabilities"][3] for p in predicted])
        result["direct_pr_3"] = [  # true and false positives at each threshold i/100
            [
                int(np.sum((probability_3 >= i / 100) & (labels["label"].numpy() == 3)))
                for i in range(101)
            ],
            [
                int(np.sum((probability_3 >= i / 100) & (labels["label"].numpy() != 3)))
                for i in range(101)
            ],
        ]
    print(json.dumps(result))


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    main(sys.argv[1], sys.argv[2], int(sys.argv[4]) if len(sys.argv) > 4 else 0)
