"""Tables read where they lie against prepared shards: the training input alone.

    python3 benchmarks/sources.py [--rows 10000] [--batches 200]

Synthetic documents (lengths 4 to 320, log-normal as in benchmarks/text_on_disk.py;
bytes as tokens) with an integer label, written three ways: prepared shards
(``prepare --text``), one Parquet file of row groups of 1,000 rows, and a folder in
``save_to_disk``'s layout. Every row reads ``--batches`` training batches of 32 from
disk (``pipeline.memory_limit_mb = 0``) through its input_fn, examples/s:

* ``shards, by index``: ``text.input_fn`` (the reference: what prepare buys);
* ``parquet, window shuffle``: ``tables.input_fn``, its order a shuffle of the row
  groups then of the rows within windows of 8 groups (the default);
* ``parquet, full shuffle``: the same rows in the order of a source read row by row
  (no windows, two groups kept decoded), what a global shuffle costs Parquet;
* ``parquet, file order``: an evaluation pass, every row once in order;
* ``arrow, full shuffle``: the save_to_disk folder, memory-mapped;
* ``jsonl, full shuffle`` and ``csv, full shuffle``: the rows as JSON lines and as
  CSV, each row read by its byte offsets (the index made before the first batch).

Each Parquet row says how many bytes were decoded per example read (the groups
decoded times their size, over the examples). Then the peak memory (the process's
resident high-water mark, TensorFlow included) of reading the Parquet file's training
batches by the window order, in a fresh process per size, as the rows grow 1x, 10x,
100x. The disk rows read from the page cache: the files were just written.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import gin  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.csv  # noqa: E402, F401
import pyarrow.parquet as pq  # noqa: E402
from absl import logging  # noqa: E402

from datasets.tables import input_fns as tables  # noqa: E402
from datasets.tables import source  # noqa: E402
from datasets.text import input_fns as text  # noqa: E402
from datasets.text import preparation  # noqa: E402
from trainer import InputParams, Mode  # noqa: E402

BATCH, ROW_GROUP = 32, 1000
COLUMNS = {"text": "text", "label": "integer"}


def corpus(rows: int, seed: int = 0) -> pa.Table:
    """``rows`` documents of printable ASCII, lengths 4 to 320, and a label of 4."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(rng.lognormal(np.log(30), 0.8, rows)), 4, 320).astype(int)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     .,;()=", np.uint8)
    texts = ["x" + bytes(rng.choice(letters, size - 1)).decode() for size in sizes]
    return pa.table({"text": texts, "label": rng.integers(0, 4, rows)})


def write(table: pa.Table, root: str) -> dict[str, str]:
    """The table as shards, a Parquet file and a save_to_disk folder: their paths."""
    jsonl, parquet = os.path.join(root, "corpus.jsonl"), os.path.join(root, "corpus.parquet")
    with open(jsonl, "w") as f:
        for row in table.to_pylist():
            f.write(json.dumps({"text": row["text"], "label": str(row["label"])}) + "\n")
    shards = os.path.join(root, "shards")
    preparation.prepare(jsonl, shards, eval_fraction=0)
    pq.write_table(table, parquet, row_group_size=ROW_GROUP)
    saved = os.path.join(root, "saved")
    os.makedirs(saved)
    with pa.OSFile(os.path.join(saved, "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=1000)
    with open(os.path.join(saved, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, f)
    in_place = {"jsonl": os.path.join(root, "table.jsonl"), "csv": os.path.join(root, "table.csv")}
    with open(in_place["jsonl"], "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in table.to_pylist())
    pa.csv.write_csv(table, in_place["csv"])
    return {"shards": shards, "parquet": parquet, "arrow": saved, **in_place}


def dataset(row: str, paths: dict, mode=Mode.TRAIN):
    """The row's batches, from disk."""
    gin.clear_config()
    gin.bind_parameter("pipeline.memory_limit_mb", 0)
    params = InputParams(BATCH, BATCH, seed=1)
    if row.startswith("shards"):
        return text.input_fn(mode, params, data_dir=paths["shards"])
    where = paths[row.split(",")[0]]
    return tables.input_fn(mode, params, train=where, eval=where, longest=400)


def rows_of(path: str):
    """The Parquet or Arrow rows ``tables.input_fn`` reads (made once a process)."""
    return source.rows_of(path, COLUMNS, None, 8)


def examples_per_second(data, batches: int) -> float:
    iterator = iter(data)
    for _ in range(5):  # warm: threads started, functions traced
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH / (time.perf_counter() - start)


def decoded_per_example(rows, examples: int) -> float:
    """Bytes of row groups decoded per example read (Parquet)."""
    return rows.decoded.decodes * rows.nbytes / len(rows.groups) / examples


def table_rows(paths: dict, batches: int) -> list[tuple[str, float, float | None]]:
    """``(row, examples/s, bytes decoded per example or None)`` of each row."""
    found = [("shards, by index", examples_per_second(dataset("shards", paths), batches), None)]
    for row in ("parquet, window shuffle", "parquet, full shuffle", "parquet, file order"):
        source.MADE.clear()
        parquet = rows_of(paths["parquet"])
        if row.endswith("full shuffle"):
            parquet.windows, parquet.decoded.size = None, 2  # read as a row-by-row source
        mode = Mode.EVAL if row.endswith("file order") else Mode.TRAIN
        data = dataset(row, paths, mode).repeat() if mode == Mode.EVAL else dataset(row, paths)
        parquet.decoded.decodes = 0
        rate = examples_per_second(data, batches)
        found.append((row, rate, decoded_per_example(parquet, (batches + 5) * BATCH)))
    source.MADE.clear()
    for row in ("arrow, full shuffle", "jsonl, full shuffle", "csv, full shuffle"):
        source.MADE.clear()
        rate = examples_per_second(dataset(row, paths), batches)
        read = rows_of(paths[row.split(",")[0]])  # a JSON line's or CSV row's own bytes
        found.append((row, rate, 0 if row.startswith("arrow") else read.nbytes / len(read)))
    return found


def peak_memory(path: str, batches: int) -> float:
    """MB: the resident high-water mark of a fresh process reading ``batches`` from ``path``."""
    out = subprocess.run(
        [sys.executable, __file__, "--memory", path, "--batches", str(batches)],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__))),
    ).stdout
    return float(out.strip().splitlines()[-1])


def read_for_memory(path: str, batches: int) -> None:
    """The child of ``peak_memory``: reads the batches, prints its peak RSS in MB."""
    logging.set_verbosity(logging.WARNING)
    examples_per_second(dataset("parquet", {"parquet": path}), batches)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--memory", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory:
        return read_for_memory(args.memory, args.batches)
    logging.set_verbosity(logging.WARNING)
    table = corpus(args.rows)
    with tempfile.TemporaryDirectory() as root:
        paths = write(table, root)
        found = table_rows(paths, args.batches)
        reference = found[0][1]
        print(f"{args.rows:,} rows, {table.column('text').nbytes / 2**20:.1f} MB of text")
        print(f"{'row':<24} {'examples/s':>11} {'/shards':>8} {'decoded B/example':>18}")
        for row, rate, decoded in found:
            said = "" if decoded is None else f"{decoded:,.0f}"
            print(f"{row:<24} {rate:>11,.0f} {rate / reference:>8.2f} {said:>18}")
        memory = {}
        for times in (1, 10, 100):
            path = os.path.join(root, f"x{times}.parquet")
            pq.write_table(pa.concat_tables([table] * times), path, row_group_size=ROW_GROUP)
            memory[times] = peak_memory(path, args.batches)
            print(f"{times:>3}x rows ({args.rows * times:,}): peak memory {memory[times]:,.0f} MB")
            os.remove(path)
    window = found[1][1] / reference
    print(
        f"parquet/shards examples/s: {window:.2f}x (window shuffle), "
        f"peak memory 100x/1x rows: {memory[100] / memory[1]:.2f}x"
    )


if __name__ == "__main__":
    main()
