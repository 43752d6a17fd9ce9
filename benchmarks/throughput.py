"""Training throughput of the framework against Keras fit and a plain tf.function loop.

    python benchmarks/throughput.py [--seconds 3] [--models mlp,alexnet] [--json out.json]

One process, one run. For each model -- the seed's MLP (784-512-512-10) and the
CIFAR-shaped AlexNet (32x32x3, convolutions 64-128-256, Dense 512), Adam, batch 128 --
on the same in-memory synthetic batch (so the input side is not what is measured), it
reports examples/s of: the framework's Estimator.train (steps_per_loop=100; for the
MLP also with XLA over each block of steps; and the Keras model, compiled, given to
the Estimator as it is), Keras Model.fit (steps_per_execution 1
and 50, jit_compile off and on), and a plain tf.function step called once per step;
each row runs ``--repeats`` times, rows taking turns, and the median is reported.
Then the framework and Keras fit under the mixed_bfloat16 policy. Each
rate is also given as a share of the machine's measured fp32 matmul peak: 6 x
parameters FLOPs per example for the MLP, 6 per multiply-add of the convolutions and
Dense layers for AlexNet.

``--models resnet20,resnet50``: CIFAR's ResNet-20 at 32x32 (batch 128) and ResNet-50
at 224x224 (batch 8, small for a CPU), the framework against Keras fit of a Keras
model of the same layers (``ResNet.keras_model``) and, for ResNet-50, of
keras.applications' ResNet50 (v1, untrained), and a plain tf.function loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import trainer  # noqa: E402, I001

trainer.quiet_start()  # first: TensorFlow loads without its start-up lines
import costs  # noqa: E402
import keras  # noqa: E402
import synthetic  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from models.alexnet import AlexNet  # noqa: E402
from models.mlp import MLP  # noqa: E402
from models.resnet import ResNet  # noqa: E402
from trainer import Estimator, set_precision  # noqa: E402
from trainer.settings import Checkpoints, Devices, Summaries  # noqa: E402

BATCH = 128
MLP_PARAMS = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10


def mlp_keras():
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def alexnet_keras():
    conv = [
        layer
        for filters in (64, 128, 256)
        for layer in (
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
        )
    ]
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            *conv,
            keras.layers.Flatten(),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10),
        ]
    )


def resnet_keras(depth: int, shape: tuple[int, ...]):
    """The framework's ResNet as a functional Keras model of its own layers."""
    return lambda: ResNet(depth=depth, num_classes=10).keras_model(shape)


def applications_resnet50():
    """keras.applications' ResNet50 (v1: the stride in the first 1x1), untrained."""
    return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=10)


# name: (image shape, the framework's model, the same model in Keras)
MODELS = {
    "mlp": ((28, 28, 1), lambda: MLP(hidden_units=[512, 512], dropout_rate=0.0), mlp_keras),
    "alexnet": ((32, 32, 3), lambda: AlexNet(num_classes=10), alexnet_keras),
    "resnet20": ((32, 32, 3), lambda: ResNet(depth=20), resnet_keras(20, (32, 32, 3))),
    "resnet50": (
        (224, 224, 3),
        lambda: ResNet(depth=50, num_classes=10),
        resnet_keras(50, (224, 224, 3)),
    ),
}
BATCHES = {"resnet50": 8}  # a small batch on CPU: 24.5 GFLOP to train each image


def training_flops(make_keras) -> float:
    """FLOPs to train on one example: 6 per multiply-add of the Conv2D and Dense layers.

    2 FLOPs per multiply-add, for the forward pass and the two products of the
    backward pass (the gradients of the inputs and of the weights). For a Dense-only
    model this is 6 x its weights, the issue's "6 x parameters" less the biases.
    """
    net = make_keras()
    macs = 0
    for layer in net.layers:
        if isinstance(layer, keras.layers.Conv2D):
            height, width, filters = layer.output.shape[1:]
            macs += height * width * filters * int(tf.size(layer.kernel)) // filters
        elif isinstance(layer, keras.layers.Dense):
            macs += int(tf.size(layer.kernel))
    return 6.0 * macs


def timed(run_steps, seconds: float, chunk: int, batch: int) -> float:
    """Examples/s of ``run_steps(chunk)`` called repeatedly for ``seconds``, after a warm-up."""
    run_steps(chunk)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run_steps(chunk)
        steps += chunk
    return steps * batch / (time.perf_counter() - start)


class Marks:
    """(step, time) marks taken while one long run trains; the rate between first and last.

    The first mark comes after tracing and the first block, so it is the warm-up.
    """

    def __init__(self, seconds: float, batch: int):
        self.seconds, self.batch, self.marks = seconds, batch, []

    def add(self, step: int) -> bool:
        """Records a mark; True once ``seconds`` have passed since the first."""
        self.marks.append((step, time.perf_counter()))
        return self.marks[-1][1] - self.marks[0][1] >= self.seconds

    def rate(self) -> float:
        (s0, t0), (s1, t1) = self.marks[0], self.marks[-1]
        return (s1 - s0) * self.batch / (t1 - t0)


def compiled(make_keras) -> keras.Model:
    """The Keras model compiled as for ``keras_fit``, to be given to the Estimator as it is."""
    net = make_keras()
    net.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return net


def framework(
    model: str, seconds: float, chunk: int, jit: bool, precision=None, keras_model=False
) -> float:
    """One Estimator.train call, as a user runs it; timed between its log steps.

    ``keras_model``: the model is the Keras one, compiled, given as it is.
    """
    shape, make_model, make_keras = MODELS[model]
    if keras_model:
        make_model = lambda: compiled(make_keras)  # noqa: E731
    batch = BATCHES.get(model, BATCH)
    input_fn = synthetic.input_fn(*synthetic.batch(batch, shape))
    marks = Marks(seconds, batch)

    class Timer(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):  # train's epochs are its log periods
            if marks.add(estimator.step):
                self.model.stop_training = True

    set_precision(precision)
    try:
        with tempfile.TemporaryDirectory() as model_dir:
            estimator = Estimator(
                make_model(),
                model_dir,
                global_batch_size=batch,
                progress=False,
                steps_per_loop=100,
                log_every_steps=chunk,
                checkpoints=Checkpoints(every_steps=None, input=False),
                summaries=Summaries(write_graph=False),
                devices=Devices(jit_compile=jit, mixed_precision=precision),
            )
            estimator.train(input_fn, 10**9, callbacks=[Timer()])
    finally:
        set_precision(None)
    return marks.rate()


def keras_fit(
    model: str,
    seconds: float,
    chunk: int,
    steps_per_execution: int,
    jit: bool,
    precision=None,
    applications: bool = False,
) -> float:
    """One Model.fit call; timed between its batch-end callbacks.

    ``applications``: keras.applications' ResNet50 instead of the model's Keras twin.
    """
    shape, _, make_keras = MODELS[model]
    if applications:
        make_keras = applications_resnet50
    batch = BATCHES.get(model, BATCH)
    images, labels = synthetic.batch(batch, shape)
    marks = Marks(seconds, batch)
    set_precision(precision)
    try:
        net = make_keras()
    finally:
        set_precision(None)
    net.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
        jit_compile=jit,
    )

    class Timer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 >= chunk and marks.add(batch + 1):
                self.model.stop_training = True

    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()
    net.fit(dataset, steps_per_epoch=10**7, epochs=1, verbose=0, callbacks=[Timer()])
    return marks.rate()


def plain_loop(model: str, seconds: float, chunk: int) -> float:
    shape, _, make_keras = MODELS[model]
    batch = BATCHES.get(model, BATCH)
    images, labels = synthetic.batch(batch, shape)
    net = make_keras()
    optimizer = keras.optimizers.Adam()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x, training=True))
        gradients = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(gradients, net.trainable_variables, strict=True))

    def run(n):
        for _ in range(n):
            step(images, labels)

    return timed(run, seconds, chunk, batch)


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


def resnet_rows(model: str, seconds: float, chunk: int) -> dict:
    """ResNet's rows: the framework, Keras fit of the same layers, and of keras.applications'."""
    rows = {
        "framework": lambda: framework(model, seconds, chunk, jit=False),
        "keras_fit_spe1": lambda: keras_fit(model, seconds, chunk, 1, jit=False),
        "keras_fit_spe50": lambda: keras_fit(model, seconds, chunk, 50, jit=False),
        "plain_tf_function": lambda: plain_loop(model, seconds, chunk),
    }
    if model == "resnet50":
        rows["keras_applications_fit_spe50"] = lambda: keras_fit(
            model, seconds, chunk, 50, jit=False, applications=True
        )
    return rows


def measure(model: str, seconds: float, repeats: int) -> dict[str, float]:
    """Median examples/s of each row; the rows take turns, so drift hits all alike."""
    chunk = {"mlp": 200, "resnet20": 5, "resnet50": 2}.get(model, 20)  # steps between marks
    if model.startswith("resnet"):
        return _medians(resnet_rows(model, seconds, chunk), repeats)
    bf16 = "mixed_bfloat16"
    rows = {"framework": lambda: framework(model, seconds, chunk, jit=False)}
    rows["compiled_keras_in_framework"] = lambda: framework(
        model, seconds, chunk, jit=False, keras_model=True
    )
    if model == "mlp":  # XLA's CPU convolutions in a compiled loop: a few examples/s
        rows["framework_xla"] = lambda: framework(model, seconds, chunk, jit=True)
    rows |= {
        "keras_fit_spe1": lambda: keras_fit(model, seconds, chunk, 1, jit=False),
        "keras_fit_spe50": lambda: keras_fit(model, seconds, chunk, 50, jit=False),
        "keras_fit_spe50_xla": lambda: keras_fit(model, seconds, chunk, 50, jit=True),
        "plain_tf_function": lambda: plain_loop(model, seconds, chunk),
    }
    rows["framework_bf16"] = lambda: framework(model, seconds, chunk, False, bf16)
    if model == "mlp":
        rows["framework_xla_bf16"] = lambda: framework(model, seconds, chunk, True, bf16)
    rows["keras_fit_spe50_bf16"] = lambda: keras_fit(model, seconds, chunk, 50, False, bf16)
    if model == "mlp":
        rows["keras_fit_spe50_xla_bf16"] = lambda: keras_fit(model, seconds, chunk, 50, True, bf16)
    return _medians(rows, repeats)


def _medians(rows: dict, repeats: int) -> dict[str, float]:
    runs = {name: [] for name in rows}
    for _ in range(repeats):
        for name, row in rows.items():
            runs[name].append(row())
    return {name: statistics.median(rates) for name, rates in runs.items()}


def flops_per_example(model: str) -> float:
    """FLOPs to train one example: 6 per multiply-add (``training_flops``)."""
    if model == "mlp":
        return 6 * MLP_PARAMS
    shape, make_model, make_keras = MODELS[model]
    if model.startswith("resnet"):  # its Keras twin's layers are blocks: read the graph
        return costs.describe(model, make_model(), shape).train_flops
    return training_flops(make_keras)


def summarize(model: str, results: dict[str, float], peak: float) -> dict[str, float]:
    """Prints one model's rows (examples/s, share of peak) and ratios; returns the ratios."""
    flops = flops_per_example(model)
    batch = BATCHES.get(model, BATCH)
    print(f"\n{model}, batch {batch}, {flops / 1e6:.0f} MFLOP per example   examples/s  % peak")
    for name, rate in results.items():
        print(f"  {name:<30}{rate:>12.0f}{100 * rate * flops / 1e9 / peak:>11.1f}%")
    float32 = {k: v for k, v in results.items() if not k.endswith("bf16")}
    best = max(v for k, v in float32.items() if k.startswith("framework"))
    best_keras = max(v for k, v in float32.items() if k.startswith("keras_fit_spe"))
    ratios = {
        "framework_best_over_keras_best": best / best_keras,
        "framework_best_over_plain": best / results["plain_tf_function"],
    }
    if "compiled_keras_in_framework" in results:
        ratios["compiled_keras_over_framework"] = (
            results["compiled_keras_in_framework"] / results["framework"]
        )
    if "keras_applications_fit_spe50" in results:
        ratios["framework_over_keras_applications"] = best / results["keras_applications_fit_spe50"]
    if any(k.endswith("bf16") for k in results):
        best_bf16 = max(v for k, v in results.items() if k.startswith("framework") and "bf16" in k)
        keras_bf16 = max(v for k, v in results.items() if k.startswith("keras") and "bf16" in k)
        ratios["bf16_best_over_float32_best"] = best_bf16 / best
        ratios["bf16_best_over_keras_bf16_best"] = best_bf16 / keras_bf16
        ratios["bf16_best_over_keras_float32_best"] = best_bf16 / best_keras
    for name, ratio in ratios.items():
        print(f"  {name:<42}{ratio:.2f}x")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per row")
    parser.add_argument(
        "--models", default="mlp,alexnet", help="comma-separated: mlp,alexnet,resnet20,resnet50"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row (median)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    peak = matmul_peak(args.seconds)
    report = {"matmul_gflops": peak}
    for model in args.models.split(","):
        results = measure(model, args.seconds, args.repeats)
        report[model] = {**results, **summarize(model, results, peak)}
    print(f"\nmatmul peak {peak:.0f} GFLOP/s (float32, 2048^3)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
