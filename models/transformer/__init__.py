"""Transformers written with Keras layers: masks, positions, blocks, and the models.

* **Masks** (``attention_bias``): a query attends to a key when both are of the same
  example (their ``segment_ids`` equal and not 0: padding is 0, and a packed row's
  examples differ, so its mask is block-diagonal) and, in a decoder, when the key is
  not later (causal). Without ``segment_ids`` a row is one example, its padding the
  tokens that are 0.
* **Positions**: ``learned`` (an embedding of each token's place in its example) or
  ``rotary`` (RoPE: queries and keys turned by their place, so attention sees
  offsets). A packed row's ``positions`` restart at each example.
* **Blocks** are pre-norm: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``. The
  layer norms, the attention logits and their softmax run in float32, also under a
  bfloat16 or float16 policy; the matrix products run in the policy's dtype.
* **Models** (gin-configurable ModelFns): ``TextClassifier`` (an encoder, the mean of
  its real tokens, a classification head), ``LanguageModel`` (a decoder, its head the
  token embedding, a loss per token that generates in PREDICT) and ``ViT`` (an image
  cut into patches, an encoder, a classification head).

Attention costs ``O(length^2)`` per row and head. Generation computes the prompt's
keys and values once and keeps every block's in a cache, so each new token costs one
token's pass through the blocks and ``O(prompt + new)`` attention: ``O(new * (prompt +
new))`` in all, where reading the sequence whole again at each token costs ``O(new *
(prompt + new)^2)``. The cache holds ``2 * depth * (prompt + new) * width`` numbers a row
(times ``beam``), reordered with the hypotheses at each step of a beam search.
"""

from models.transformer.blocks import (
    NEG,
    Attention,
    Block,
    Transformer,
    attention_bias,
    checked_ids,
    positions_of,
    rotated,
    segments_of,
)
from models.transformer.tasks import BYTES, LanguageModel, TextClassifier, ViT, bytes_text

__all__ = [
    "NEG", "Attention", "Block", "Transformer", "attention_bias", "checked_ids",
    "positions_of", "rotated", "segments_of", "BYTES", "LanguageModel", "TextClassifier",
    "ViT", "bytes_text",
]  # fmt: skip
