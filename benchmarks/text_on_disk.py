"""Prepared text read from disk against the same text held in memory: the input alone.

    python benchmarks/text_on_disk.py [--documents 20000] [--batches 300]

One process. ``prepare --text`` writes a file of synthetic documents (lengths 4 to
320, log-normal as in benchmarks/sequences.py; bytes as tokens), then each row reads
``--batches`` global batches of 32 from the training pipeline, once held in memory
and once past ``pipeline.memory_limit_mb`` (0 here), from the files:

* ``windows``: ``text.windows_input_fn`` (windows of 256 tokens): in memory, or one
  read of the token stream by offset per window;
* ``grouped``: ``text.input_fn`` with ``lengths.group_batches = 50`` and geometric
  buckets: in memory, or each document read from its shard by offset, the order
  sorted from the lengths prepare kept.

Then the seconds to the first batch of each from disk when a run resumes at step 0
and at step 1,000,000. The disk rows read from the page cache: the files were just
written, as they are on a machine whose memory holds them but whose
``memory_limit_mb`` does not; a colder disk adds its seek per window or document.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gin  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

from datasets import lengths  # noqa: E402
from datasets.text import input_fns, preparation, windows  # noqa: E402
from trainer import InputParams, Mode  # noqa: E402

BATCH = 32


def corpus(path: str, documents: int, seed: int = 0) -> None:
    """JSON lines of ``documents`` texts of printable ASCII, lengths 4 to 320."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(rng.lognormal(np.log(30), 0.8, documents)), 4, 320).astype(int)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     .,;()=", np.uint8)
    with open(path, "w") as f:
        for size in sizes:
            body = bytes(rng.choice(letters, size)).decode()
            f.write(json.dumps({"text": "x" + body[1:]}) + "\n")


def bind(row: str, on_disk: bool) -> None:
    gin.clear_config()
    gin.bind_parameter("pipeline.memory_limit_mb", 0 if on_disk else None)
    if row == "grouped":
        gin.bind_parameter("lengths.group_batches", 50)
        gin.bind_parameter("lengths.buckets", lengths.geometric(8, 320))


def dataset(row: str, data_dir: str, start_step: int = 0):
    params = InputParams(BATCH, BATCH, seed=1, start_example=start_step * BATCH)
    if row == "windows":
        return windows.windows_input_fn(Mode.TRAIN, params, data_dir=data_dir, length=256)
    return input_fns.input_fn(Mode.TRAIN, params, data_dir=data_dir)


def tokens_per_second(row: str, data_dir: str, batches: int) -> float:
    iterator = iter(dataset(row, data_dir))
    for _ in range(5):  # warm: threads started, functions traced
        next(iterator)
    start, tokens = time.perf_counter(), 0
    for _ in range(batches):
        features, _ = next(iterator)
        tokens += int(np.count_nonzero(features["tokens"]))
    return tokens / (time.perf_counter() - start)


def first_batch_seconds(row: str, data_dir: str, step: int) -> float:
    start = time.perf_counter()
    next(iter(dataset(row, data_dir, step)))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, default=20_000)
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    with tempfile.TemporaryDirectory() as root:
        source = os.path.join(root, "corpus.jsonl")
        corpus(source, args.documents)
        data_dir = os.path.join(root, "data")
        metadata = preparation.prepare(source, data_dir, eval_fraction=0)
        print(f"{args.documents:,} documents, {metadata['splits']['train']['tokens']:,} tokens")
        print(f"{'row':<10} {'held, tokens/s':>15} {'disk, tokens/s':>15} {'ratio':>6}")
        for row in ("windows", "grouped"):
            rates = []
            for on_disk in (False, True):
                bind(row, on_disk)
                rates.append(tokens_per_second(row, data_dir, args.batches))
            print(f"{row:<10} {rates[0]:>15,.0f} {rates[1]:>15,.0f} {rates[1] / rates[0]:>6.2f}")
        for row in ("windows", "grouped"):
            bind(row, on_disk=True)
            zero, far = (first_batch_seconds(row, data_dir, s) for s in (0, 1_000_000))
            print(f"{row} from disk, first batch at step 0: {zero:.2f}s, at 1,000,000: {far:.2f}s")


if __name__ == "__main__":
    main()
