"""The ids chats are prepared in: bytes, or the tokens of a keras-hub model's own tokenizer.

``prepare --chat`` and ``--pairs`` render each chat to text (``templates``), then
tokenize it here and mark which tokens are the assistant's:

* ``Bytes`` (the default): each UTF-8 byte its value plus one (0 pads), and an end
  id after them, 257; what ``models.transformer.LanguageModel`` reads.
* ``Preset``: the tokenizer of a keras-hub preset (``--preset DIR``: a directory
  written by ``save_to_preset``, or in Hugging Face's layout), the model's own ids and
  its end token: what that model (a ``GPT2CausalLM``, a ``GemmaCausalLM``, given as it
  is) reads, and what its preprocessor makes of a prompt when it generates.

A token is the assistant's when the bytes it stands for overlap a ``{% generation %}``
span, as Hugging Face's ``return_assistant_tokens_mask`` marks a token holding any of
a span's characters. The text is tokenized whole, as the model reads it, and each
token's place in it is found:

* byte-pair tokenizers (GPT-2's, Llama 3's, Qwen's) spell the text's bytes exactly,
  one character of their alphabet a byte, so each token's bytes follow the last's;
* SentencePiece tokenizers (Gemma's, Llama 2's, Mistral's) give each token's byte
  offsets as they tokenize (tensorflow-text's ``tokenize_with_offsets``, the op
  keras-hub's tokenizer runs).

WordPiece drops the spaces and marks words' insides (``##``): refused in one line.
Tokenizing costs one call per chunk of chats, and the marks a pass over each chat's
tokens: time linear in the text, memory in one chunk.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from datasets.chat.templates import Rendered
from trainer import UserError, errors


class Bytes:
    """Each UTF-8 byte its own id, plus one (0 pads); 257 ends a chat."""

    name = "bytes"
    vocab_size = 258
    end = 257

    def ids_and_masks(self, rendered: list[Rendered]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each chat's ids and which are the assistant's."""
        return [chat.bytes_and_mask() for chat in rendered]

    def described(self) -> dict:
        """What ``dataset.json`` says of the ids."""
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "end_of_document": self.end}


class Preset:
    """The tokenizer of a keras-hub preset, each token's place in the text known.

    Args:
      preset: a directory written by ``save_to_preset``, or in Hugging Face's layout
        (a preset's name too, where there is internet).
    """

    def __init__(self, preset: str):
        self.preset = preset
        tokenizer = _load(preset)
        self.name = type(tokenizer).__name__
        self.vocab_size = int(tokenizer.vocabulary_size())
        self.end = _end_id(tokenizer, preset)
        self._placed = _placement(tokenizer, preset)

    def ids_and_masks(self, rendered: list[Rendered]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each chat's token ids and which are the assistant's, tokenized in one call."""
        placed = self._placed([chat.text for chat in rendered])
        return [
            (ids, chat.token_mask(starts, ends))
            for chat, (ids, starts, ends) in zip(rendered, placed, strict=True)
        ]

    def described(self) -> dict:
        """What ``dataset.json`` says of the ids: the tokenizer, and the preset it is of."""
        return {
            "tokenizer": self.name,
            "preset": os.path.abspath(self.preset) if os.path.isdir(self.preset) else self.preset,
            "vocab_size": self.vocab_size,
            "end_of_document": self.end,
        }


Placed = list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # each text's ids, starts, ends


def _placement(tokenizer, preset: str) -> Callable[[list[str]], Placed]:
    """``texts -> each one's (ids, start bytes, end bytes)`` by ``tokenizer``'s kind."""
    import keras_hub

    if isinstance(tokenizer, keras_hub.tokenizers.BytePairTokenizer):
        return _spelled(tokenizer, preset)
    if isinstance(tokenizer, keras_hub.tokenizers.SentencePieceTokenizer):
        return _offsets(tokenizer)
    raise UserError(
        f"--preset {preset}: its tokenizer is a {type(tokenizer).__name__}, which gives no "
        "token's place in the text, so the assistant's tokens cannot be found; chats are "
        "prepared with byte-pair (GPT-2's, Llama 3's, Qwen's) or SentencePiece (Gemma's, "
        "Llama 2's, Mistral's) tokenizers, or bytes (leave --preset out)"
    )


def _spelled(tokenizer, preset: str) -> Callable[[list[str]], Placed]:
    """A byte-pair tokenizer's placement: each token's bytes follow the last token's."""
    sizes = _token_sizes(tokenizer.vocabulary, int(tokenizer.vocabulary_size()))

    def placed(texts: list[str]) -> Placed:
        found = []
        for text, ids in zip(texts, tokenizer(texts), strict=True):
            ids = np.asarray(ids, np.int64)
            ends = np.cumsum(sizes[ids])
            size = len(text.encode())
            if ends[-1:].sum() != size:
                raise UserError(
                    f"--preset {preset}: its {type(tokenizer).__name__} does not spell the "
                    f"chat's bytes back ({ends[-1:].sum():,} of {size:,}), so the assistant's "
                    "tokens cannot be found: use its byte-pair tokenizer as saved"
                )
            found.append((ids, ends - sizes[ids], ends))
        return found

    return placed


def _offsets(tokenizer) -> Callable[[list[str]], Placed]:
    """A SentencePiece tokenizer's placement: the offsets its op gives with the ids."""
    import tensorflow as tf
    import tensorflow_text

    pieces = tensorflow_text.SentencepieceTokenizer(model=tokenizer.proto, out_type=tf.int32)

    def placed(texts: list[str]) -> Placed:
        ids, starts, ends = pieces.tokenize_with_offsets(tf.constant(texts))
        rows = ids.row_splits.numpy()[1:-1]
        split = [
            np.split(r.flat_values.numpy().astype(np.int64), rows) for r in (ids, starts, ends)
        ]
        return list(zip(*split, strict=True))

    return placed


def tokenizer_of(preset: str | None) -> Bytes | Preset:
    """Bytes, or the tokenizer of ``preset``."""
    return Bytes() if preset is None else Preset(preset)


def _load(preset: str):
    """The preset's tokenizer; one line if there is none."""
    try:
        import keras_hub
    except ImportError:
        raise UserError(
            '--preset needs keras-hub: pip install -e ".[text]" (keras-hub, tensorflow-text)'
        ) from None
    if not os.path.isdir(preset) and (os.sep in preset or preset.startswith(".")):
        raise UserError(
            f"--preset {preset}: no such folder; give a directory written by save_to_preset "
            "or in Hugging Face's layout (or, with internet, a preset's name)"
        )
    try:
        return keras_hub.tokenizers.Tokenizer.from_preset(preset)
    except (ValueError, FileNotFoundError, OSError) as error:
        raise UserError(
            f"--preset {preset}: no tokenizer loads from it ({errors.first_line(error)}): give "
            "a directory written by save_to_preset, or in Hugging Face's layout"
        ) from None


def _end_id(tokenizer, preset: str) -> int:
    """The id that ends a document, which ends each chat."""
    end = getattr(tokenizer, "end_token_id", None)
    if end is None:
        raise UserError(
            f"--preset {preset}: its {type(tokenizer).__name__} names no end token, so a chat's "
            "end cannot be marked: give a preset whose tokenizer has one"
        )
    return int(end)


def _token_sizes(vocabulary: dict, size: int) -> np.ndarray:
    """How many bytes of text each id stands for.

    A byte-pair token is spelled in GPT-2's alphabet, one character a byte; a token added
    whole (``<|endoftext|>``) may hold characters outside it, which stand for their UTF-8.
    """
    sizes = np.zeros(size, np.int64)
    for token, index in vocabulary.items():
        sizes[index] = sum(1 if c in ALPHABET else len(c.encode()) for c in token)
    return sizes


def _alphabet() -> frozenset[str]:
    """GPT-2's byte alphabet: the printable bytes as themselves, the 68 others from U+0100."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = range(256, 256 + 256 - len(printable))
    return frozenset(map(chr, [*printable, *others]))


ALPHABET = _alphabet()
