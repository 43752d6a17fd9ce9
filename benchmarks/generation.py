"""Generation's speed as the text grows: a byte-level language model continuing prompts.

    python benchmarks/generation.py [--repeats 3]

The model is ``experiments/stdlib_lm.gin``'s shape (``models/transformer/``: width
128, 2 blocks, 4 heads, rotary positions, 257 byte ids), with random weights; a batch
of 8 prompts of 64 bytes is continued greedily by 64, 128 and 256 new bytes, each
generation traced once, then timed (the median of ``--repeats``).

Each new token runs the blocks alone against a cache of the earlier tokens' keys and
values, so its cost grows with the text so far, not with its square: tokens/s falls
slowly as the text grows. The last line:

    tokens/s at 256 new / at 64 new: R.RR (0.43 without the cache, each token reading all again)

Measured here (2 cores): 4,840, 4,320 and 3,417 tokens/s at 64, 128 and 256 new (0.71);
before the cache, 782, 560 and 338 (0.43): 6.2x to 10.1x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import trainer  # noqa: E402, I001

trainer.quiet_start()
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from models import transformer  # noqa: E402
from trainer import Mode  # noqa: E402

BATCH, PROMPT = 8, 64


def tokens_per_second(new: int, repeats: int) -> float:
    """New tokens/s of greedy generation of ``new`` tokens after each prompt."""
    keras.utils.set_random_seed(0)
    stack = transformer.Transformer(width=128, depth=2, heads=4, positions="rotary")
    model = transformer.LanguageModel(257, stack, generate=new)
    prompts = tf.random.stateless_uniform([BATCH, PROMPT], [0, 1], 1, 257, tf.int64)
    generate = tf.function(
        lambda p: model({"tokens": p}, None, Mode.PREDICT).predictions["generated"]
    )
    generate(prompts).numpy()  # traced
    took = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(prompts).numpy()
        took.append(time.perf_counter() - start)
    return BATCH * new / statistics.median(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rates = {new: tokens_per_second(new, args.repeats) for new in (64, 128, 256)}
    for new, rate in rates.items():
        print(f"prompt {PROMPT}, {new:>3} new, batch {BATCH}: {rate:8.0f} tokens/s")
    print(
        f"tokens/s at 256 new / at 64 new: {rates[256] / rates[64]:.2f} "
        "(0.43 without the cache, each token reading all again)"
    )


if __name__ == "__main__":
    main()
