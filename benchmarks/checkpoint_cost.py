"""What a checkpoint costs training: saves in the background against saves that wait.

    python benchmarks/checkpoint_cost.py [--steps 80] [--every 20] [--repeats 2] [--json F]

One process, one run. A 17.2M-parameter MLP (784-4096-3400-10) with Adam, whose
checkpoint (the weights and Adam's two moments) is 206 MB, trains on one in-memory
batch three ways, taking turns: without checkpoints; saving every ``--every`` steps in
the background (``async_checkpoints``, the default on one device); and saving every
``--every`` steps, waiting for each. Each run is timed from its second block's end
(tracing done, and the first save, which always waits) until ``train`` returns, its
last save whole. The training time a save costs is (that time - the time without
saves) / the saves in that time, the median of ``--repeats`` runs; the ratio of the
two costs is what background saves win.
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
import keras  # noqa: E402
import synthetic  # noqa: E402
from absl import logging  # noqa: E402

from models.mlp import MLP  # noqa: E402
from trainer import Estimator  # noqa: E402
from trainer.settings import Checkpoints, Summaries  # noqa: E402

BATCH = 64
HIDDEN = [4096, 3400]
PARAMETERS = 784 * 4096 + 4096 + 4096 * 3400 + 3400 + 3400 * 10 + 10


def run(steps: int, every: int, save: bool, background: bool) -> tuple[float, int, int]:
    """Seconds from the second block's end to ``train``'s return, and the saves made."""
    input_fn = synthetic.input_fn(*synthetic.batch(BATCH))
    marks: list[float] = []

    def block_done(batch, logs):  # the first block's save waits, as a run's first
        marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            MLP(hidden_units=HIDDEN),
            model_dir,
            global_batch_size=BATCH,
            progress=False,
            steps_per_loop=every,
            log_every_steps=every,
            checkpoints=Checkpoints(
                every_steps=every if save else None, keep=2, background=background, input=False
            ),
            summaries=Summaries(write_graph=False),
        )
        timer = keras.callbacks.LambdaCallback(on_train_batch_end=block_done)
        estimator.train(input_fn, steps, callbacks=[timer])
        seconds = time.perf_counter() - marks[1]
        saves = steps // every - 1 if save else 0  # those after the second block's mark
        size = sum(
            os.path.getsize(os.path.join(model_dir, f))
            for f in os.listdir(model_dir)
            if f.startswith(f"ckpt-{steps}.")
        )
    return seconds, saves, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    ways = {
        "no saves": (False, False),
        "background": (True, True),
        "waiting": (True, False),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    saves, size = 0, 0
    for _ in range(args.repeats):
        for name, (save, background) in ways.items():
            seconds, count, bytes_ = run(args.steps, args.every, save, background)
            times[name].append(seconds)
            saves, size = max(saves, count), max(size, bytes_)
    median = {name: statistics.median(values) for name, values in times.items()}
    cost = {name: (median[name] - median["no saves"]) / saves for name in ("background", "waiting")}
    print(
        f"{PARAMETERS / 1e6:.1f}M parameters with Adam, checkpoint {size / 1e6:.0f} MB, "
        f"{args.steps} steps of batch {BATCH}, a save every {args.every}"
    )
    for name in ways:
        line = f"  {name:<11} {median[name]:7.2f} s"
        if name in cost:
            line += f"   {cost[name]:6.3f} s of training lost per save"
        print(line)
    ratio = cost["waiting"] / cost["background"] if cost["background"] > 0 else float("inf")
    print(f"  a save that waits costs {ratio:.1f}x one in the background")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": median, "cost_per_save": cost, "bytes": size}, f, indent=2)


if __name__ == "__main__":
    main()
