"""Tokens/s of a small Transformer encoder on text-like lengths: grouped and bucketed,
against every batch padded to the longest example there is.

    python benchmarks/sequences.py [--seconds 15] [--repeats 2] [--examples 20000]

One process, one run. The source: 20,000 examples of lengths 4 to 320 (log-normal,
median 30, mean 44: a long tail), token ids in memory as a ``tf.RaggedTensor``, read
by index. The model: a 2-block Transformer encoder (width 64, 4 heads, the padding
masked from attention and from the pooling), compiled as Keras users compile it and
given to the Estimator as it is; global batch 32, Adam. Three rows take turns
(``--repeats``), each one ``Estimator.train`` timed between its log steps:

* padded: every batch padded to 320 (``lengths.buckets = [320]``);
* bucketed: ``lengths.group_batches = 50`` and ``lengths.buckets =
  @lengths.geometric()`` (8 to 320, each 1.15x the last: 25 buckets);
* budgeted: the same, in batches by ``lengths.token_budget = 4096`` (at most 128
  examples, the global batch): 12 to 128 examples a batch.

Tokens/s counts the real (non-pad) tokens of the batches trained between the first
and last log step, read again from the same stream; the padding share is the pad
tokens' share of one epoch of each order's batches.

Then the same examples as a language model's (``models/transformer/``'s
``LanguageModel``: 2 blocks of width 64, a loss per token, each token's next its
target), whose loss per token lets packing lay several examples in one row: rows
``lm padded`` and ``lm bucketed`` as above, and ``lm packed``, each batch's examples
end to end in rows of 320 positions (``packing.length = 320``), the attention
block-diagonal. Then, for the bucketed row, the
bytes of input state in a 3-step run's checkpoint, and the seconds to the first batch
when a run resumes at step 0 and at step 20,000 (its window sorted anew). The last
line:

    bucketed/padded tokens/s: R.RRx (padding share B% vs P%)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trainer  # noqa: E402, I001

trainer.quiet_start()
import gin  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from benchmarks import timing  # noqa: E402
from datasets import lengths, pipeline  # noqa: E402
from models.transformer import LanguageModel, Transformer  # noqa: E402
from trainer import Estimator, InputParams, Mode  # noqa: E402
from trainer.settings import Checkpoints, Summaries  # noqa: E402

BATCH, LONGEST, VOCAB, WIDTH = 32, 320, 1000, 64
BUDGET, MOST = 4096, 128  # the budgeted row: 4,096 padded positions, at most 128 examples
ROWS = {
    "padded": {"lengths.buckets": [LONGEST]},
    "bucketed": {"lengths.group_batches": 50, "lengths.buckets": lengths.geometric(8, LONGEST)},
    "budgeted": {
        "lengths.group_batches": 50,
        "lengths.buckets": lengths.geometric(8, LONGEST),
        "lengths.token_budget": BUDGET,
    },
}
LM_ROWS = {
    "lm padded": ROWS["padded"],
    "lm bucketed": ROWS["bucketed"],
    "lm packed": {"packing.length": LONGEST},
}


def text_lengths(count: int, seed: int = 0) -> np.ndarray:
    """Log-normal lengths, 4 to 320: median 30, mean 44, a few hundred past 200."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(np.exp(rng.normal(3.4, 0.9, count))), 4, LONGEST).astype(np.int64)


def text_source(count: int) -> pipeline.ArraySource:
    """Token ids 1..VOCAB-1 (0 pads), and a label that depends on them."""
    sizes = text_lengths(count)
    values = np.random.default_rng(1).integers(1, VOCAB, sizes.sum())
    tokens = tf.RaggedTensor.from_row_lengths(values, sizes)
    labels = np.add.reduceat(values, np.concatenate([[0], np.cumsum(sizes)[:-1]])) % 2
    return pipeline.ArraySource({"tokens": tokens, "label": labels}, "text")


class Positions(keras.layers.Layer):
    """Learned position embeddings added to the tokens', the mask passed on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(LONGEST, WIDTH)
        self.supports_masking = True

    def call(self, x):
        return x + self.embedding(keras.ops.arange(keras.ops.shape(x)[1]))


def transformer() -> keras.Model:
    tokens = keras.Input((None,), dtype="int64", name="tokens")
    x = Positions()(keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(tokens))
    for _ in range(2):
        attended = keras.layers.MultiHeadAttention(4, WIDTH // 4)(x, x)
        x = keras.layers.LayerNormalization()(x + attended)
        hidden = keras.layers.Dense(2 * WIDTH, activation="relu")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(WIDTH)(hidden))
    logits = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(tokens, logits)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def language_model():
    return LanguageModel(VOCAB, Transformer(width=WIDTH, depth=2, heads=4, positions="rotary"))


def next_tokens(example: dict):
    """A language model's preprocess: the tokens, and each one's next as its target."""
    tokens = example["tokens"]
    return {"tokens": tokens[:-1]}, {"targets": tokens[1:]}


def tokens_and_label(example: dict):
    """The preprocess: one function, so its results are held once and reused."""
    return example["tokens"], example["label"]


def input_fn_of(source: pipeline.ArraySource, preprocess=tokens_and_label):
    def input_fn(mode, params):
        return pipeline.build(source, mode, params, preprocess, name="text")

    return input_fn


def bound(row: str):
    """The row's gin bindings, in force until the block ends."""
    gin.clear_config()
    for name, value in (ROWS | LM_ROWS)[row].items():
        gin.bind_parameter(name, value)


def real_tokens(features) -> np.ndarray:
    """Which positions of a batch hold tokens: its packed rows' segments, or its non-pads."""
    if isinstance(features, dict):
        return features.get("segment_ids", features["tokens"]) != 0
    return features != 0


def batch_of(row: str) -> int:
    """The row's global batch: with a token budget, the most examples a batch takes."""
    return MOST if "lengths.token_budget" in ROWS.get(row, {}) else BATCH


def stream(row: str, input_fn, start_step: int, steps: int) -> list[np.ndarray]:
    """Which positions hold tokens in the batches of steps ``[start_step, start_step + steps)``."""
    params = InputParams(batch_of(row), batch_of(row), seed=0)
    dataset = input_fn(Mode.TRAIN, params).skip(start_step).take(steps)
    return [real_tokens(features) for features, _ in dataset.as_numpy_iterator()]


def tokens_per_second(row: str, source, seconds: float, chunk: int = 20) -> float:
    """Real tokens/s of one Estimator.train, between its first and last log step."""
    bound(row)
    lm = row in LM_ROWS
    input_fn = input_fn_of(source, next_tokens if lm else tokens_and_label)

    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            language_model() if lm else transformer(),
            model_dir,
            optimizer=keras.optimizers.Adam(1e-3) if lm else None,
            global_batch_size=batch_of(row),
            seed=0,
            progress=False,
            steps_per_loop=chunk,
            log_every_steps=chunk,
            checkpoints=Checkpoints(every_steps=None, input=False),
            summaries=Summaries(write_graph=False),
        )
        timer = timing.StopAfter(seconds, lambda: estimator.step)
        estimator.train(input_fn, 10**9, callbacks=[timer])
    (s0, t0), (s1, t1) = timer.marks[0], timer.marks[-1]
    real = sum(int(b.sum()) for b in stream(row, input_fn, s0, s1 - s0))
    return real / (t1 - t0)


def padding_share(row: str, source) -> float:
    """Pad tokens' share of all tokens in one epoch of the row's training batches."""
    bound(row)
    preprocess = next_tokens if row in LM_ROWS else tokens_and_label
    params = InputParams(batch_of(row), batch_of(row), seed=0)
    batches, read = [], 0
    for features, _ in input_fn_of(source, preprocess)(Mode.TRAIN, params).as_numpy_iterator():
        batches.append(real_tokens(features))
        read += len(batches[-1])
        if read + batch_of(row) > len(source):  # an epoch's whole batches
            break
    return 1 - sum(int(b.sum()) for b in batches) / sum(b.size for b in batches)


def input_state_and_resume(source) -> dict[str, float]:
    """The bucketed row's input state in a checkpoint, and its first batch on resuming."""
    bound("bucketed")
    input_fn, found = input_fn_of(source), {}
    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            transformer(), model_dir, global_batch_size=BATCH, seed=0, progress=False
        )
        estimator.train(input_fn, 3)
        path = tf.train.latest_checkpoint(model_dir)
        model = ("model/", "optimizer/", "rng/", "step/", "save_counter/", "_CHECKPOINTABLE")
        found["input state bytes"] = sum(
            np.asarray(tf.train.load_checkpoint(path).get_tensor(key)).nbytes
            for key, _ in tf.train.list_variables(path)
            if not key.startswith(model)
        )
        for step in (0, 20_000):
            first_batch_seconds(estimator, input_fn, step)  # warm-up
            found[f"first batch at step {step:,} (s)"] = min(
                first_batch_seconds(estimator, input_fn, step) for _ in range(3)
            )
    return found


def first_batch_seconds(estimator: Estimator, input_fn, step: int) -> float:
    """Seconds from building the training input at ``step`` to its first batch."""
    estimator.inputs.position.assign(step * BATCH)
    start = time.perf_counter()
    next(estimator.inputs.train_iterator(input_fn, step))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--examples", type=int, default=20_000)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    source = text_source(args.examples)
    sizes = text_lengths(args.examples)
    print(
        f"{args.examples:,} examples, lengths {sizes.min()} to {sizes.max()} (median "
        f"{np.median(sizes):.0f}, mean {sizes.mean():.1f}); global batch {BATCH}"
    )
    rows = [*ROWS, *LM_ROWS]
    rates = {row: [] for row in rows}
    for _ in range(args.repeats):  # rows take turns
        for row in rows:
            rates[row].append(tokens_per_second(row, source, args.seconds))
    shares = {row: padding_share(row, source) for row in rows}
    resumed = input_state_and_resume(source)
    print(f"{'row':<12} {'tokens/s':>10} {'padding share':>14}")
    for row in rows:
        print(f"{row:<12} {statistics.median(rates[row]):>10.0f} {shares[row]:>13.1%}")
    lm = {row: statistics.median(rates[f"lm {row}"]) for row in ("padded", "bucketed", "packed")}
    print(
        f"language model: packed/padded tokens/s {lm['packed'] / lm['padded']:.2f}x, "
        f"bucketed/padded {lm['bucketed'] / lm['padded']:.2f}x"
    )
    for name, value in resumed.items():
        print(f"bucketed: {name:<30} {value:.3g}")
    budgeted = statistics.median(rates["budgeted"]) / statistics.median(rates["bucketed"])
    print(
        f"budgeted/bucketed tokens/s: {budgeted:.2f}x (a budget of {BUDGET:,} positions, at "
        f"most {MOST} examples, against {BATCH} examples a batch)"
    )
    ratio = statistics.median(rates["bucketed"]) / statistics.median(rates["padded"])
    print(
        f"bucketed/padded tokens/s: {ratio:.2f}x (padding share {shares['bucketed']:.0%} "
        f"vs {shares['padded']:.0%})"
    )


if __name__ == "__main__":
    main()
