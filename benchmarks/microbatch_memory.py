"""What micro-batches save: the memory a training step takes, its batch in k slices.

    python benchmarks/microbatch_memory.py [--batch 16384] [--ks 1,2,4,8] [--json F]

One process. An MLP of 4096-2048-2048 units (15.9 M parameters, Adam) trains on one
in-memory batch of 28x28 images with ``Optimization.microbatches = k``, for each k in
turn. After a first step (tracing done), TensorFlow's allocator statistics for the
device are reset and two more steps run: the step's memory is the allocator's peak
minus what was held before (the weights, Adam's moments, the input batch). The
activations grow with the slice, so they should fall about k-fold; what stays is the
weights' gradients, plus one more copy of the weights' size for the slices' sum.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import trainer  # noqa: E402, I001

trainer.quiet_start()  # first: TensorFlow loads without its start-up lines
import synthetic  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from models.mlp import MLP  # noqa: E402
from trainer import Estimator  # noqa: E402
from trainer.settings import Checkpoints, Optimization, Summaries  # noqa: E402

HIDDEN = [1024, 1024, 1024]
PARAMETERS = 784 * 1024 + 1024 + 2 * (1024 * 1024 + 1024) + 1024 * 10 + 10
DEVICE = "CPU:0" if not tf.config.list_physical_devices("GPU") else "GPU:0"


def step_memory(k: int, batch: int) -> int:
    """Bytes a training step allocates above what is held between steps."""
    input_fn = synthetic.input_fn(*synthetic.batch(batch))

    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            MLP(hidden_units=HIDDEN, dropout_rate=0.0),
            model_dir,
            global_batch_size=batch,
            optimization=Optimization(microbatches=k),
            progress=False,
            steps_per_loop=1,
            checkpoints=Checkpoints(every_steps=None, input=False),
            summaries=Summaries(write_graph=False),
        )
        estimator.train(input_fn, 1)  # traced
        tf.config.experimental.reset_memory_stats(DEVICE)
        held = tf.config.experimental.get_memory_info(DEVICE)["current"]
        estimator.train(input_fn, 3)
        return tf.config.experimental.get_memory_info(DEVICE)["peak"] - held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    used = {k: step_memory(k, args.batch) for k in map(int, args.ks.split(","))}
    print(
        f"MLP {HIDDEN} ({PARAMETERS / 1e6:.1f}M parameters, {PARAMETERS * 4 / 2**20:.0f} MiB) "
        f"with Adam, batch {args.batch} of 28x28 images: memory a step takes on {DEVICE}"
    )
    first = used[min(used)]
    for k, size in used.items():
        print(f"  microbatches {k}: {size / 2**20:7.0f} MiB   {first / max(size, 1):4.1f}x less")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": DEVICE, "step_bytes": used}, f, indent=2)


if __name__ == "__main__":
    main()
