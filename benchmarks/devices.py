"""What splitting a step over devices costs: measured on logical CPUs, modelled for GPUs.

    python benchmarks/devices.py [--seconds 3] [--json out.json] [--model_only]

Measured: the MLP (784-H-H-10, Adam, global batch 128, H = 512 and 2048) on
in-memory synthetic data, trained by Estimator.train on one device, with towers on
2 and 4 logical CPU devices, and with MirroredStrategy on 2 and 4, each set-up in a
fresh process (logical devices are fixed when TensorFlow starts). The global batch
is the same, so the extra time per step is what the split, the gathering or
all-reduce of the gradient and the devices' coordination cost; the two widths part
it into a fixed cost per step and a cost per gradient byte. Logical CPU devices share
one memory and two cores: nothing here is a speed-up, and a byte costs a copy, not a
link's transfer.

Modelled (``costs.py``): bytes through the busiest link and the step's efficiency
for AlexNet (ImageNet, 62M parameters) and the MLP on 2, 8 and 8 x 4 GPUs, with the
fixed costs measured here added.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import costs

SETUPS = ["towers:1", "towers:2", "towers:4", "mirrored:2", "mirrored:4"]
WIDTHS = [512, 2048]
BATCH = 128


def measure(setup: str, width: int, seconds: float) -> float:
    """Examples/s of one set-up, in this process (which must be fresh)."""
    from trainer import parallel

    parallel.split_cpu(4)

    import tensorflow as tf
    from absl import logging

    from models.mlp import MLP
    from trainer import Estimator

    logging.set_verbosity(logging.WARNING)
    distribution, _, devices = setup.partition(":")
    images = tf.random.stateless_uniform([BATCH, 28, 28, 1], seed=[1, 2])
    labels = tf.random.stateless_uniform([BATCH], seed=[3, 4], maxval=10, dtype=tf.int64)

    def input_fn(mode, params):
        n = params.batch_size  # per replica under a strategy
        return tf.data.Dataset.from_tensors(({"image": images[:n]}, {"label": labels[:n]})).repeat()

    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            MLP(hidden_units=[width, width]),
            model_dir,
            global_batch_size=BATCH,
            progress=False,
            steps_per_loop=100,
            log_every_steps=10**9,
            save_checkpoints_steps=None,
            write_graph=False,
            checkpoint_input=False,
            distribution=distribution,
            num_devices=int(devices),
        )
        estimator.train(input_fn, 100)  # warm-up: tracing and the first block
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            estimator.train(input_fn, estimator.step + 200)
            steps += 200
        return steps * BATCH / (time.perf_counter() - start)


def measure_all(seconds: float) -> dict[str, dict[str, float]]:
    """Examples/s of every set-up and width, each in a child process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    results: dict[str, dict[str, float]] = {}
    for width in WIDTHS:
        for setup in SETUPS:
            command = [sys.executable, __file__, "--setup", f"{setup}@{width}"]
            child = subprocess.run(
                [*command, "--seconds", str(seconds)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if child.returncode:
                sys.exit(f"{setup} failed:\n{child.stderr[-2000:]}")
            rate = float(child.stdout.strip().splitlines()[-1])
            results.setdefault(str(width), {})[setup] = rate
            print(f"MLP {width:<5} {setup:<11} {rate:>9,.0f} examples/s", flush=True)
    return results


def fixed_costs(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Extra seconds per step against one device, split into fixed + per gradient byte.

    A straight line through the two widths' extra time against their gradient bytes:
    its value at zero bytes is the fixed cost of a step on that set-up.
    """
    fits = {}
    sizes = {w: 4 * ((784 + 1) * w + (w + 1) * w + (w + 1) * 10) for w in WIDTHS}
    for setup in SETUPS[1:]:
        extra = {
            w: BATCH / results[str(w)][setup] - BATCH / results[str(w)]["towers:1"] for w in WIDTHS
        }
        small, large = WIDTHS
        per_byte = (extra[large] - extra[small]) / (sizes[large] - sizes[small])
        fixed = extra[small] - per_byte * sizes[small]
        fits[setup] = {"extra": extra, "fixed": fixed, "per_byte": per_byte}
    return fits


def print_measured(results, fits) -> None:
    one = {w: BATCH / results[str(w)]["towers:1"] for w in WIDTHS}
    print("\nMeasured on logical CPUs, extra time per step against one device (same batch):")
    for w in WIDTHS:
        print(f"  MLP {w}: one device {one[w] * 1e3:.2f} ms per step")
    for setup, fit in fits.items():
        extras = ", ".join(f"MLP {w} {fit['extra'][w] * 1e3:+.2f} ms" for w in WIDTHS)
        rate = "n/a" if fit["per_byte"] <= 0 else f"{1 / fit['per_byte'] / 1e9:.1f} GB/s"
        print(f"  {setup:<11} {extras}; fixed {fit['fixed'] * 1e3:+.2f} ms, per byte as {rate}")


def networks() -> list[costs.Network]:
    from trainer import parallel

    parallel.split_cpu(1)
    from models.alexnet import AlexNet
    from models.mlp import MLP

    alexnet = AlexNet(  # experiments/alexnet_imagenet.gin
        num_classes=1000,
        conv_filters=[96, 256, 384, 384, 256],
        kernel_size=[11, 5, 3, 3, 3],
        strides=[4, 1, 1, 1, 1],
        pool_size=[3, 3, 0, 0, 3],
        pool_strides=2,
        dense_units=[4096, 4096],
    )
    return [
        costs.describe("AlexNet (ImageNet)", alexnet, (224, 224, 3)),
        costs.describe("MLP 784-512-512-10", MLP(hidden_units=[512, 512]), (28, 28, 1)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per set-up")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--model_only", action="store_true", help="print the model only")
    parser.add_argument("--setup", help=argparse.SUPPRESS)  # one set-up, in a child process
    args = parser.parse_args()
    if args.setup:
        setup, _, width = args.setup.partition("@")
        print(json.dumps(measure(setup, int(width), args.seconds)))
        return
    fixed = {"towers": 0.0, "ring": 0.0}
    results, fits = {}, {}
    if not args.model_only:
        results = measure_all(args.seconds)
        fits = fixed_costs(results)
        print_measured(results, fits)
        fixed = {
            "towers": max(fits["towers:2"]["fixed"], 0.0),
            "ring": max(fits["mirrored:2"]["fixed"], 0.0),
        }
    nets = networks()
    print(
        "\nModelled on GPUs (benchmarks/costs.py), per-GPU batch "
        f"{costs.PER_DEVICE_BATCH}, {costs.UTILIZATION:.0%} of bf16 peak:"
    )
    print("\n".join(costs.compute_lines(nets)))
    if not args.model_only:
        print(
            f"fixed cost per step, measured above on 2 devices: towers "
            f"{fixed['towers'] * 1e3:.2f} ms, all-reduce {fixed['ring'] * 1e3:.2f} ms"
        )
    print("\n".join(costs.table(nets, fixed)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"examples_per_sec": results, "global_batch": BATCH, "fixed_seconds": fixed},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
