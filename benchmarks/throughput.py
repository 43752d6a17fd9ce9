"""Training throughput of the framework against Keras fit and a plain tf.function loop.

    python benchmarks/throughput.py [--seconds 3] [--json out.json]

One process, one run, the same model (the seed's MLP, 784-512-512-10, Adam), the same
in-memory synthetic batch of 128, so the input side is not what is measured. Reports
examples/s of: the framework's Estimator.train (steps_per_loop=100, with and without
XLA for the step), Keras Model.fit (steps_per_execution 1 and 50, jit_compile off and
on), a plain tf.function step called once per step; and the machine's fp32 matmul
peak, with the fraction of it each reaches (6 x parameters FLOPs per example).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from models.mlp import MLP  # noqa: E402
from trainer import Estimator  # noqa: E402

BATCH, UNITS = 128, [512, 512]
PARAMS = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10


def data():
    images = tf.random.stateless_uniform([BATCH, 28, 28, 1], seed=[1, 2])
    labels = tf.random.stateless_uniform([BATCH], seed=[3, 4], maxval=10, dtype=tf.int64)
    return images, labels


def timed(run_steps, seconds: float) -> float:
    """Examples/s of ``run_steps(n)`` over about ``seconds``, after one warm-up call."""
    run_steps(100)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run_steps(200)
        steps += 200
    return steps * BATCH / (time.perf_counter() - start)


def framework(seconds: float, jit: bool) -> float:
    images, labels = data()

    def input_fn(mode, params):
        return tf.data.Dataset.from_tensors(({"image": images}, {"label": labels})).repeat()

    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            MLP(hidden_units=UNITS),
            model_dir,
            global_batch_size=BATCH,
            steps_per_loop=100,
            log_every_steps=10**9,
            save_checkpoints_steps=None,
            write_graph=False,
            checkpoint_input=False,
            jit_compile=jit,
        )
        return timed(lambda n: estimator.train(input_fn, estimator.step + n), seconds)


def keras_model():
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def keras_fit(seconds: float, steps_per_execution: int, jit: bool) -> float:
    images, labels = data()
    model = keras_model()
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
        jit_compile=jit,
    )
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()
    return timed(lambda n: model.fit(dataset, steps_per_epoch=n, epochs=1, verbose=0), seconds)


def plain_loop(seconds: float) -> float:
    images, labels = data()
    model = keras_model()
    optimizer = keras.optimizers.Adam()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(
            zip(
                tape.gradient(loss, model.trainable_variables),
                model.trainable_variables,
                strict=True,
            )
        )

    def run(n):
        for _ in range(n):
            step(images, labels)

    return timed(run, seconds)


def matmul_peak(seconds: float) -> float:
    """GFLOP/s of a 2048^3 float32 matmul."""
    a = tf.random.uniform([2048, 2048])
    matmul = tf.function(lambda x: tf.reduce_sum(x @ x))
    matmul(a).numpy()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        matmul(a).numpy()
        count += 1
    return count * 2 * 2048**3 / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    results = {
        "framework": framework(args.seconds, jit=False),
        "framework_xla": framework(args.seconds, jit=True),
        "keras_fit_spe1": keras_fit(args.seconds, 1, jit=False),
        "keras_fit_spe50": keras_fit(args.seconds, 50, jit=False),
        "keras_fit_spe50_xla": keras_fit(args.seconds, 50, jit=True),
        "plain_tf_function": plain_loop(args.seconds),
    }
    peak = matmul_peak(args.seconds)
    best_keras = max(v for k, v in results.items() if k.startswith("keras"))
    print(f"{'MLP 784-512-512-10, batch 128':<32}{'examples/s':>12}{'% fp32 peak':>13}")
    for name, rate in results.items():
        print(f"{name:<32}{rate:>12.0f}{100 * rate * 6 * PARAMS / 1e9 / peak:>12.1f}%")
    print(f"matmul peak {peak:.0f} GFLOP/s")
    best = max(results["framework"], results["framework_xla"])
    print(
        f"framework best / Keras fit best {best / best_keras:.2f}x; "
        f"/ plain loop {best / results['plain_tf_function']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "matmul_gflops": peak}, f, indent=2)


if __name__ == "__main__":
    main()
