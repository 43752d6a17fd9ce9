"""What splitting a step over devices costs: measured on logical CPUs, modelled for GPUs.

    python benchmarks/devices.py [--seconds 3] [--json out.json] [--model_only]

Measured: the MLP (784-512-512-10, Adam, global batch 128) on in-memory synthetic
data, trained by Estimator.train on one device, with towers on 2 and 4 logical CPU
devices and with MirroredStrategy on 2 and 4, each set-up in a fresh process
(logical devices are fixed when TensorFlow starts). The global batch is the same, so
the extra time per step is what the split, the reduction of the gradient and the
coordination of the devices cost. Logical CPU devices share one memory and two
cores: nothing here is a speed-up, MirroredStrategy reduces on one device (NCCL's
ring is for GPUs), and a byte costs a memory copy, not a link's transfer. These
figures choose the default on logical CPUs (``devices.choose`` in trainer/distributed/devices.py).

Modelled (``costs.py``): bytes through the busiest link and the step's efficiency
for AlexNet (ImageNet, 62M parameters) and the MLP on 2, 8 and 8 x 4 GPUs, which
choose the default on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import trainer  # noqa: E402, I001

trainer.quiet_start()  # first: TensorFlow loads without its start-up lines
import costs  # noqa: E402

from trainer.settings import Checkpoints, Devices, Summaries  # noqa: E402

SETUPS = ["towers:1", "towers:2", "towers:4", "mirrored:2", "mirrored:4"]
BATCH = 128


def measure(setup: str, seconds: float) -> float:
    """Examples/s of one set-up, in this process (which must be fresh)."""
    from trainer.distributed import strategies

    strategies.split_cpu(4)

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
            checkpoints=Checkpoints(every_steps=None, input=False),
            summaries=Summaries(write_graph=False),
            devices=Devices(distribution=distribution, count=int(devices)),
        )
        estimator.train(input_fn, 100)  # warm-up: tracing and the first block
        steps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            estimator.train(input_fn, estimator.step + 200)
            steps += 200
        return steps * BATCH / (time.perf_counter() - start)


def measure_all(seconds: float) -> dict[str, float]:
    """Examples/s of every set-up, each in a child process."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    results = {}
    for setup in SETUPS:
        child = subprocess.run(
            [sys.executable, __file__, "--setup", setup, "--seconds", str(seconds)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if child.returncode:
            sys.exit(f"{setup} failed:\n{child.stderr[-2000:]}")
        results[setup] = float(child.stdout.strip().splitlines()[-1])
        print(f"{setup:<11} {results[setup]:>9,.0f} examples/s", flush=True)
    one = BATCH / results["towers:1"]
    print(f"\nagainst one device ({one * 1e3:.2f} ms per step), extra time per step:")
    for setup, rate in list(results.items())[1:]:
        extra = BATCH / rate - one
        print(f"  {setup:<11} {extra * 1e3:+6.2f} ms  ({rate / results['towers:1']:.2f}x the rate)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per set-up")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--model_only", action="store_true", help="print the model only")
    parser.add_argument("--setup", help=argparse.SUPPRESS)  # one set-up, in a child process
    args = parser.parse_args()
    if args.setup:
        print(json.dumps(measure(args.setup, args.seconds)))
        return
    results = {} if args.model_only else measure_all(args.seconds)
    nets = costs.networks()
    print(
        f"\nModelled on GPUs (benchmarks/costs.py), {costs.PER_DEVICE_BATCH} examples per GPU "
        f"at {costs.UTILIZATION:.0%} of bf16 peak:"
    )
    print("\n".join(costs.compute_lines(nets)))
    print("\n".join(costs.table(nets)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"examples_per_sec": results, "global_batch": BATCH}, f, indent=2)


if __name__ == "__main__":
    main()
