"""The cost of DPO's reference pass, against the DPO training it serves.

    python benchmarks/reference_pass.py [--seconds 30]

One process, one run. The data: the standard library's preference pairs
(``datasets.stdlib.pairs``: 1,728, a tenth held out), prepared by ``prepare --pairs``
into a temporary folder. The model: ``experiments/stdlib_dpo.gin``'s (a 2-block
``PreferenceModel`` of width 128), its reference a checkpoint of the same model.
Three rows:

* pass, row order: every pair of both splits scored in row order, batches of 64
  padded to the recipe's buckets (192, 384, 640 bytes);
* pass, shortest first: the same, the pairs read shortest first (what
  ``python3 -m datasets.chat.reference`` does), the scores put back by row;
* DPO training: ``Estimator.train`` on the stored scores (batches of 16, the same
  buckets, lengths grouped as the recipe groups them), timed between its log steps
  after the first.

Pairs/s of each. The reference pass runs once; a reference model held in memory
would run the same forward pass on every pair of every epoch, inside the steps.
The last lines:

    pass shortest first/row order pairs/s: R.RRx
    reference pass / one epoch of DPO training: R.RRx
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trainer  # noqa: E402, I001

trainer.quiet_start()
import functools  # noqa: E402

import gin  # noqa: E402
import keras  # noqa: E402
from absl import logging  # noqa: E402

from benchmarks import timing  # noqa: E402
from datasets import stdlib  # noqa: E402
from datasets.chat import input_fns, pairs, reference  # noqa: E402
from datasets.records import shards  # noqa: E402
from models.preference import PreferenceModel  # noqa: E402
from models.transformer import Transformer  # noqa: E402
from trainer import Estimator  # noqa: E402
from trainer.settings import Checkpoints, Summaries  # noqa: E402

BATCH, EVAL_BATCH = 16, 64
BUCKETS = [192, 384, 640]


def prepared(root: str) -> str:
    """The pairs written and prepared under ``root``."""
    source = os.path.join(root, "pairs.jsonl")
    assert stdlib.main(["stdlib", "--pairs", source]) == 0
    out = os.path.join(root, "pairs")
    pairs.prepare(source, out)
    return out


def model(loss: str = "dpo") -> PreferenceModel:
    keras.utils.set_random_seed(0)
    stack = Transformer(width=128, depth=2, heads=4, positions="rotary")
    return PreferenceModel(vocab_size=258, stack=stack, loss=loss, beta=0.1)


def estimator(model_dir: str, loss: str = "dpo", **settings) -> Estimator:
    return Estimator(
        model(loss),
        model_dir,
        optimizer=keras.optimizers.AdamW(2e-5),
        global_batch_size=BATCH,
        eval_batch_size=EVAL_BATCH,
        seed=0,
        progress=False,
        checkpoints=Checkpoints(every_steps=None, input=False),
        summaries=Summaries(write_graph=False),
        **settings,
    )


def pass_rate(data_dir: str, reference_dir: str, shortest_first: bool) -> float:
    """Pairs scored per second by the reference pass over both splits."""
    started = time.perf_counter()
    found = reference.score(estimator(reference_dir), data_dir, reference_dir, shortest_first)
    return sum(len(v) for v in found.values()) / (time.perf_counter() - started)


def training_rate(data_dir: str, reference_dir: str, seconds: float, chunk: int = 10) -> float:
    """Pairs per second of DPO training on the stored scores, between log steps."""
    gin.bind_parameter("lengths.group_batches", 25)

    input_fn = functools.partial(
        input_fns.pairs_input_fn, data_dir=data_dir, reference=reference_dir
    )
    with tempfile.TemporaryDirectory() as model_dir:
        run = estimator(model_dir, steps_per_loop=chunk, log_every_steps=chunk)
        timer = timing.StopAfter(seconds, lambda: run.step)
        run.train(input_fn, 10**9, callbacks=[timer])
    gin.bind_parameter("lengths.group_batches", 0)
    (s0, t0), (s1, t1) = timer.marks[1], timer.marks[-1]  # the first period traces the step
    return (s1 - s0) * BATCH / (t1 - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    gin.bind_parameter("lengths.buckets", BUCKETS)  # a few shapes to trace, as the recipe
    with tempfile.TemporaryDirectory() as root:
        data_dir = prepared(root)
        reference_dir = os.path.join(root, "reference")  # a checkpoint to score with:
        read = functools.partial(input_fns.pairs_input_fn, data_dir=data_dir)
        estimator(reference_dir, "simpo").train(read, 1)  # one step of SimPO, no reference
        rates = {
            "pass, row order": pass_rate(data_dir, reference_dir, False),
            "pass, shortest first": pass_rate(data_dir, reference_dir, True),
            "DPO training": training_rate(data_dir, reference_dir, args.seconds),
        }
        counts = {k: v["count"] for k, v in shards.read_metadata(data_dir)["splits"].items()}
    for row, rate in rates.items():
        print(f"{row:<22} pairs/s {rate:>8,.1f}")
    ratio = rates["pass, shortest first"] / rates["pass, row order"]
    print(f"pass shortest first/row order pairs/s: {ratio:.2f}x")
    passed = sum(counts.values()) / rates["pass, shortest first"]
    epoch = counts["train"] / rates["DPO training"]
    print(f"reference pass / one epoch of DPO training: {passed / epoch:.2f}x")


if __name__ == "__main__":
    main()
