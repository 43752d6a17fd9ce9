"""A reference model's log-probabilities of prepared pairs, kept beside them by row.

DPO weighs each answer's log-probability under the model it trains against the one
a reference model (the model it starts from) gave the same answer. Those are scored
once (``python3 -m datasets.chat.reference``) and written beside the shards:
``<split>-reference.npy``, float32 ``[pairs, 2]`` (the chosen answer's, the rejected
one's), and ``reference.json``, which names the checkpoint that scored them (and
the digest of its index, which holds a checksum of every tensor) and what was
scored (each split's ``dataset.json`` entry, with the digest of its records).

Training reads a pair's two numbers with its record, by the same row (``Scored``):
epochs, replicas, workers and a resume read them as they read the pairs, for 8
bytes a pair in memory, and no second model. Scores of another checkpoint, or of
pairs since prepared again, are refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import tensorflow as tf

from datasets.records import shards
from datasets.sources import RandomAccess
from trainer import UserError, checkpoints

SCORE = "python3 -m datasets.chat.reference --gin_file <the experiment's gin file>"


def identity(reference: str) -> dict:
    """The checkpoint that scores for ``reference`` (a model_dir: its newest) and its digest."""
    path = checkpoints.latest_checkpoint(reference) if tf.io.gfile.isdir(reference) else None
    if path is None:
        raise UserError(
            f"chat.pairs_input_fn.reference = {reference!r} holds no checkpoint: train the "
            "reference model there first (the model DPO starts from, e.g. an SFT run's "
            "model_dir), or point it at that model_dir"
        )
    with tf.io.gfile.GFile(path + ".index", "rb") as f:
        return {"checkpoint": path, "weights": hashlib.sha256(f.read()).hexdigest()[:32]}


def of_split(entry: dict) -> str:
    """A digest of a split as prepared: its ``dataset.json`` entry, its records' digest in it."""
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:32]


def write(data_dir: str, scorer: dict, scored: dict[str, np.ndarray], metadata: dict) -> None:
    """Each split's scores, then the record of what scored them, last.

    The old record goes first: a write cut short leaves no record, so the scores
    are scored again rather than read as another checkpoint's.
    """
    record = os.path.join(data_dir, shards.SCORES)
    if tf.io.gfile.exists(record):
        tf.io.gfile.remove(record)
    splits = {}
    for split, values in scored.items():
        name = shards.SCORED.format(split=split)
        with tf.io.gfile.GFile(os.path.join(data_dir, name), "wb") as f:
            np.save(f, np.asarray(values, np.float32))
        splits[split] = {
            "file": name,
            "pairs": len(values),
            "prepared": of_split(metadata["splits"][split]),
        }
    with tf.io.gfile.GFile(record + ".tmp", "w") as f:
        json.dump({**scorer, "splits": splits}, f, indent=2)
    tf.io.gfile.rename(record + ".tmp", record, overwrite=True)


def read(data_dir: str, split: str, reference: str, metadata: dict) -> np.ndarray:
    """``[pairs, 2]``: the split's scores, once checked to be ``reference``'s of these pairs."""
    path = os.path.join(data_dir, shards.SCORES)
    if not tf.io.gfile.exists(path):
        raise UserError(
            f"{data_dir} has no reference log-probabilities for DPO ({shards.SCORES}): "
            f"score the pairs with the reference model first: {SCORE}"
        )
    with tf.io.gfile.GFile(path) as f:
        record = json.load(f)
    entry = record["splits"].get(split)
    if entry is None:
        raise UserError(
            f"{path} holds no scores of the {split} split: score the pairs again: {SCORE}"
        )
    scorer = identity(reference)
    if record["weights"] != scorer["weights"]:
        raise UserError(
            f"{path} holds the log-probabilities of {record['checkpoint']}, not of "
            f"{scorer['checkpoint']} (chat.pairs_input_fn.reference's newest checkpoint): "
            f"score the pairs with it: {SCORE}"
        )
    if entry["prepared"] != of_split(metadata["splits"][split]):
        raise UserError(
            f"{path} scored the {split} split as it was prepared before; it has been "
            f"prepared again since: score the pairs again: {SCORE}"
        )
    with tf.io.gfile.GFile(os.path.join(data_dir, entry["file"]), "rb") as f:
        return np.load(f)


class Scored(RandomAccess):
    """Records with their row's scores: ``read`` gives ``{'record', 'reference'}``.

    Args:
      records: the pairs' records, read by index.
      values: ``[len(records), 2]``, the scores by row.
    """

    def __init__(self, records: RandomAccess, values: np.ndarray):
        self.records, self.values = records, np.asarray(values, np.float32)
        self._tensor = None

    def __len__(self) -> int:
        return len(self.records)

    @property
    def nbytes(self) -> int | None:
        """The records' bytes and the scores'."""
        size = getattr(self.records, "nbytes", None)
        return None if size is None else size + self.values.nbytes

    def read(self, rows: tf.Tensor) -> dict:
        """The records at ``rows`` and their scores ``[len(rows), 2]``."""
        if self._tensor is None:
            with tf.init_scope():  # made once, captured by every dataset that reads
                self._tensor = tf.constant(self.values)
        return {"record": self.records.read(rows), "reference": tf.gather(self._tensor, rows)}


class Rearranged(RandomAccess):
    """Records read in another order: its row ``i`` is the records' row ``order[i]``.

    The reference pass reads the pairs shortest first, so that each batch pads little.
    """

    def __init__(self, records: RandomAccess, order: np.ndarray):
        self.records, self.order = records, np.asarray(order, np.int64)
        self._tensor = None

    def __len__(self) -> int:
        return len(self.records)

    def read(self, rows: tf.Tensor) -> tf.Tensor:
        """The records at ``order[rows]``."""
        if self._tensor is None:
            with tf.init_scope():
                self._tensor = tf.constant(self.order)
        return self.records.read(tf.gather(self._tensor, rows))
