"""Examples that vary in length, each row naming its example: for tests/test_lengths.py
and tests/test_token_budget.py."""

import numpy as np
import tensorflow as tf

from datasets import pipeline

COUNT = 203  # epochs end mid-batch and mid-window


def long_tailed(count=COUNT, seed=0):
    """Lengths 1 to 60, most of them short: as sentences are."""
    rng = np.random.default_rng(seed)
    return np.minimum(1 + rng.geometric(0.08, count), 60)


def source(sizes):
    """Example i is ``i + 1`` repeated ``sizes[i]`` times: each row names its example."""
    tokens = tf.ragged.constant([[i + 1] * int(n) for i, n in enumerate(sizes)], dtype=tf.int64)
    return pipeline.ArraySource({"tokens": tokens, "label": np.arange(len(sizes)) % 3}, "text")


def examples_of(tokens, sizes):
    """The example in each padded row, checking the row: its tokens, then zeros."""
    found = []
    for row in tokens:
        example = int(row[0]) - 1
        n = sizes[example]
        assert list(row[:n]) == [example + 1] * n and not row[n:].any(), row
        found.append(example)
    return found
