"""Training throughput on 1, 2 and 4 devices at the same global batch.

    python benchmarks/devices.py [--seconds 3] [--json out.json]

The seed's MLP (784-512-512-10, Adam, global batch 128) on in-memory synthetic data,
trained by Estimator.train with towers and with MirroredStrategy on 1, 2 and 4
logical CPU devices. Each set-up runs in a process of its own (logical devices are
fixed when TensorFlow starts, and two MirroredStrategies of different sizes cannot
share a process). On a machine whose cores all serve one CPU device no speed-up is
possible; the table shows what splitting a step costs: the overhead of towers and
of the strategy against one device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SETUPS = ["towers:1", "towers:2", "towers:4", "mirrored:1", "mirrored:2", "mirrored:4"]
BATCH = 128


def measure(setup: str, seconds: float) -> float:
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
            MLP(hidden_units=[512, 512]),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per set-up")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--setup", help=argparse.SUPPRESS)  # one set-up, in a child process
    args = parser.parse_args()
    if args.setup:
        print(json.dumps(measure(args.setup, args.seconds)))
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    results = {}
    for setup in SETUPS:
        child = subprocess.run(
            [sys.executable, __file__, "--setup", setup, "--seconds", str(args.seconds)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if child.returncode:
            sys.exit(f"{setup} failed:\n{child.stderr[-2000:]}")
        results[setup] = float(child.stdout.strip().splitlines()[-1])
        print(f"{setup:<12} {results[setup]:>9,.0f} examples/s", flush=True)
    one = results["towers:1"]
    print("\nagainst one device (towers:1):")
    for setup, rate in results.items():
        print(f"  {setup:<12} {rate / one:5.2f}x   ({(1 - rate / one) * 100:+.0f}% slower)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"examples_per_sec": results, "global_batch": BATCH}, f, indent=2)


if __name__ == "__main__":
    main()
