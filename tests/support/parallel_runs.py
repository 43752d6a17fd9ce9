"""Trains the digits MLP under several device set-ups in one process; prints JSON.

Run by tests/test_parallel.py as a subprocess, because logical CPU devices must be
configured before TensorFlow starts:

    python tests/support/parallel_runs.py OUT_DIR DATA_DIR RUN [RUN ...]

RUN is ``DISTRIBUTION:DEVICES@GLOBAL_BATCH``, e.g. ``towers:4@30``; ``towers:1`` is the
single-device reference. A ``/keras`` suffix trains with Keras's own Adam update
instead of the fused kernel the framework uses where it can (strategies use Keras's);
``/clip`` (or ``/keras+clip``) clips the gradient's global norm to 0.1; ``/compiled``
gives the Estimator the MLP as a compiled Keras model, its optimizer from ``compile``;
``/micro4`` takes each batch in 4 micro-batches; ``/mix`` mixes the training batches
(MixUp and CutMix, bound in gin as a user binds them).
Every run trains 50 steps from the same seed; the JSON maps each RUN to its train-loss
and gradient-norm curves (every 10 steps), final weights and eval metrics.
"""

import itertools
import json
import os
import sys

import lean_start  # noqa: F401 - TensorFlow loads as the command line loads it

from trainer.distributed import strategies

strategies.split_cpu(4)

import gin  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

import datasets.digits  # noqa: E402
from models.mlp import MLP  # noqa: E402
from trainer import Estimator, InputParams, Mode  # noqa: E402
from trainer.settings import Devices, Optimization, Summaries  # noqa: E402


class KerasAdam(keras.optimizers.Adam):
    """Adam with Keras's update: ``optimization.fused_update`` fuses Adam itself only."""


def compiled_mlp(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    """The MLP as a Keras user writes it: a compiled Sequential."""
    model = keras.Sequential(
        [keras.Input((8, 8, 1), name="image"), keras.layers.Flatten()]
        + [keras.layers.Dense(64, activation="relu") for _ in range(2)]
        + [keras.layers.Dense(10)]
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer, loss=loss, metrics=["accuracy"])
    return model


def train(out_dir: str, data_dir: str, run: str) -> dict:
    setup, _, batch = run.partition("@")
    batch, _, options = batch.partition("/")
    options = options.split("+")
    distribution, _, devices = setup.partition(":")
    keras.utils.set_random_seed(0)
    optimizer = (KerasAdam if "keras" in options else keras.optimizers.Adam)(1e-3)
    compiled = "compiled" in options
    model = compiled_mlp(optimizer) if compiled else None
    estimator = Estimator(
        model or MLP(num_classes=10, hidden_units=[64, 64], dropout_rate=0.0),
        os.path.join(out_dir, "".join(c if c.isalnum() else "_" for c in run)),
        optimizer=None if compiled else optimizer,
        optimization=Optimization(
            clip_gradient_norm=0.1 if "clip" in options else None,
            microbatches=4 if "micro4" in options else 1,
        ),
        global_batch_size=int(batch),
        steps_per_loop=10,
        log_every_steps=10,
        seed=0,
        summaries=Summaries(write_graph=False),
        devices=Devices(distribution=distribution, count=int(devices)),
    )

    def input_fn(mode, params):
        return datasets.digits.input_fn(mode, params, data_dir=data_dir)

    logged = []
    at_blocks = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda _, logs: logged.append(
            {**logs, "gradient_norm": float(estimator.model.steps.gradient_norm.numpy())}
        )
    )
    mixing = ["mixing.mixup_alpha = 0.4", "mixing.cutmix_alpha = 1.0", "mixing.num_classes = 10"]
    gin.parse_config(mixing if "mix" in options else [])
    try:
        estimator.train(input_fn, 50, callbacks=[at_blocks])  # a block ends at each log step
    finally:
        gin.clear_config()
    result = {
        "losses": [logs["loss"] for logs in logged],
        "gradient_norms": [logs["gradient_norm"] for logs in logged],
        "weights": [np.asarray(v.numpy()).tolist() for v in estimator.model_fn.trainable_variables],
        "metrics": estimator.evaluate(input_fn),
    }
    if compiled:  # the user's Keras object holds the trained weights
        features, _ = next(iter(input_fn(Mode.EVAL, InputParams(8, 8))))
        result["keras_predict"] = model.predict(features["image"], verbose=0).tolist()
        ours = itertools.islice(estimator.predict(input_fn), 8)
        result["predict"] = [p["output"].tolist() for p in ours]
    return result


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    out, data, *runs = sys.argv[1:]
    print(json.dumps({run: train(out, data, run) for run in runs}))
