"""Tokens/s of supervised fine-tuning on chats, against the same model pre-training on them.

    python benchmarks/sft.py [--seconds 20] [--repeats 2]

One process, one run. The data: the standard library's docstring-to-function chats
(``datasets.stdlib.chats``: 1,728), prepared by ``prepare --chat`` (ChatML) into a
temporary folder and read by ``chat.input_fn``, packed in rows of 640 bytes. The
model: ``experiments/stdlib_sft.gin``'s (a 2-block ``LanguageModel`` of width 128,
430,000 parameters), global batch 16, AdamW. Two rows take turns (``--repeats``),
each one ``Estimator.train`` timed between its log steps:

* pre-training: the chats' every token learned (the mask dropped in preprocess);
* sft: the assistant's tokens alone (the mask kept): the loss counts a third of them;
* lora: sft through rank-8 LoRA adapters on the blocks' projections (``models/lora.py``,
  ``experiments/stdlib_sft_lora.gin``'s), over the model's first weights, frozen.

Tokens/s counts the tokens the model reads (each row's real positions), the same
batches in every row. The last lines:

    sft/pre-training tokens/s: R.RRx
    lora/sft tokens/s: R.RRx
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

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
from datasets import stdlib  # noqa: E402
from datasets.chat import input_fns, preparation  # noqa: E402
from models.lora import LoRA  # noqa: E402
from models.transformer import LanguageModel, Transformer  # noqa: E402
from trainer import Estimator, InputParams, Mode  # noqa: E402
from trainer.settings import Checkpoints, Summaries  # noqa: E402

BATCH, LENGTH = 16, 640
ROWS = ("pre-training", "sft", "lora")


def prepared(root: str) -> str:
    """The chats written and prepared under ``root``."""
    source = os.path.join(root, "chats.jsonl")
    assert stdlib.main(["stdlib", "--chats", source]) == 0
    out = os.path.join(root, "chats")
    preparation.prepare(source, out)
    return out


def input_fn_of(data_dir: str, row: str):
    """The row's input_fn: the chats, their mask kept (sft) or dropped (pre-training)."""

    def input_fn(mode, params):
        dataset = input_fns.input_fn(mode, params, data_dir=data_dir)
        if row != "pre-training":
            return dataset
        return dataset.map(lambda features, labels: (features, {"targets": labels["targets"]}))

    return input_fn


def model() -> LanguageModel:
    keras.utils.set_random_seed(0)
    stack = Transformer(width=128, depth=2, heads=4, positions="rotary")
    return LanguageModel(vocab_size=258, stack=stack, bytes=True)


def base_of(root: str) -> str:
    """``model()``'s first weights in a checkpoint under ``root``: the lora row's base."""
    made = model()
    made({"tokens": tf.ones([1, 4], tf.int32)}, None, Mode.PREDICT)
    return tf.train.Checkpoint(model=made).write(os.path.join(root, "base", "ckpt"))


def model_of(row: str, base: str):
    """The row's model: ``model()``, or for lora its adapters over ``base``."""
    if row != "lora":
        return model()
    return LoRA(model(), base, rank=8, alpha=16)


def read_tokens(input_fn, start_step: int, steps: int) -> int:
    """The real positions of the training batches of steps ``[start_step, start_step + steps)``."""
    params = InputParams(BATCH, BATCH, seed=0)
    dataset = input_fn(Mode.TRAIN, params).skip(start_step).take(steps)
    return sum(int((f["segment_ids"] > 0).sum()) for f, _ in dataset.as_numpy_iterator())


def tokens_per_second(data_dir: str, row: str, seconds: float, base: str, chunk: int = 10) -> float:
    """Tokens read per second by one Estimator.train, between its first and last log step."""
    gin.bind_parameter("packing.length", LENGTH)
    gin.bind_parameter("packing.rows_multiple", 8)
    input_fn = input_fn_of(data_dir, row)

    with tempfile.TemporaryDirectory() as model_dir:
        estimator = Estimator(
            model_of(row, base),
            model_dir,
            optimizer=keras.optimizers.AdamW(1e-3),
            global_batch_size=BATCH,
            seed=0,
            progress=False,
            steps_per_loop=chunk,
            log_every_steps=chunk,
            checkpoints=Checkpoints(every_steps=None, input=False),
            summaries=Summaries(write_graph=False),
        )
        timer = timing.StopAfter(seconds, lambda: estimator.step)
        estimator.train(input_fn, 10**9, callbacks=[timer])
    (s0, t0), (s1, t1) = timer.marks[1], timer.marks[-1]  # the first period traces the step
    return read_tokens(input_fn, s0, s1 - s0) / (t1 - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    with tempfile.TemporaryDirectory() as root:
        data_dir, base = prepared(root), base_of(root)
        rates: dict[str, list[float]] = {row: [] for row in ROWS}
        for _ in range(args.repeats):
            for row in ROWS:
                rates[row].append(tokens_per_second(data_dir, row, args.seconds, base))
                gin.clear_config()
    for row in ROWS:
        print(f"{row:<14} tokens/s {statistics.median(rates[row]):>9,.0f}  ({rates[row]})")
    ratio = statistics.median(rates["sft"]) / statistics.median(rates["pre-training"])
    print(f"sft/pre-training tokens/s: {ratio:.2f}x")
    adapters = statistics.median(rates["lora"]) / statistics.median(rates["sft"])
    print(f"lora/sft tokens/s: {adapters:.2f}x")
    assert np.isfinite(ratio) and np.isfinite(adapters)


if __name__ == "__main__":
    main()
