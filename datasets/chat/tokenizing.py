"""The ids chats are prepared in: bytes, or the tokens of a keras-hub model's own tokenizer.

``prepare --chat`` and ``--pairs`` render each chat to text (``templates``), then
tokenize it here and mark which tokens are the assistant's:

* ``Bytes`` (the default): each UTF-8 byte its value plus one (0 pads), and an end
  id after them, 257; what ``models.transformer.LanguageModel`` reads.
* ``Preset``: the tokenizer of a keras-hub preset (``--preset DIR``: a directory
  written by ``save_to_preset``, or in Hugging Face's layout), the model's own ids and
  its end token: what that model (a ``GPT2CausalLM`` given as it is) reads, and what
  its preprocessor makes of a prompt when it generates.

A token is the assistant's when its bytes overlap a ``{% generation %}`` span, as
Hugging Face's ``return_assistant_tokens_mask`` marks a token holding any of a span's
characters. The text is tokenized whole, as the model reads it, and each token's place
in it is found from the bytes it stands for: a byte-pair tokenizer's tokens (GPT-2's,
Llama 3's, Qwen's) spell the text's bytes exactly, one alphabet character a byte. Other
tokenizers (SentencePiece, WordPiece) drop or add spaces and are refused for now.

Tokenizing costs one call per chunk of chats (keras-hub's Python path, Hugging Face's
``tokenizers`` in Rust), and the marks a pass over each chat's tokens: time linear in
the text, memory in one chunk.
"""

from __future__ import annotations

import os

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
    """The tokenizer of a keras-hub preset: a byte-pair one, each token's bytes known.

    Args:
      preset: a directory written by ``save_to_preset``, or in Hugging Face's layout
        (a preset's name too, where there is internet).
    """

    def __init__(self, preset: str):
        self.preset = preset
        self._tokenizer = _load(preset)
        self.name = type(self._tokenizer).__name__
        self.vocab_size = int(self._tokenizer.vocabulary_size())
        self.end = _end_id(self._tokenizer, preset)
        self._sizes = _token_sizes(self._tokenizer.vocabulary, self.vocab_size)

    def ids_and_masks(self, rendered: list[Rendered]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each chat's token ids and which are the assistant's, tokenized in one call."""
        found = []
        for chat, ids in zip(rendered, self._tokenizer([c.text for c in rendered]), strict=True):
            ids = np.asarray(ids, np.int64)
            ends = np.cumsum(self._sizes[ids])
            if ends[-1:].sum() != len(chat.text.encode()):
                raise UserError(
                    f"--preset {self.preset}: its {self.name} does not spell the chat's bytes "
                    f"back ({ends[-1:].sum():,} of {len(chat.text.encode()):,}), so the "
                    "assistant's tokens cannot be found: use its byte-pair tokenizer as saved"
                )
            found.append((ids, chat.token_mask(ends - self._sizes[ids], ends)))
        return found

    def described(self) -> dict:
        """What ``dataset.json`` says of the ids: the tokenizer, and the preset it is of."""
        return {
            "tokenizer": self.name,
            "preset": os.path.abspath(self.preset) if os.path.isdir(self.preset) else self.preset,
            "vocab_size": self.vocab_size,
            "end_of_document": self.end,
        }


def tokenizer_of(preset: str | None) -> Bytes | Preset:
    """Bytes, or the tokenizer of ``preset``."""
    return Bytes() if preset is None else Preset(preset)


def _load(preset: str):
    """The preset's tokenizer, if it is a byte-pair one; one line else."""
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
        tokenizer = keras_hub.tokenizers.Tokenizer.from_preset(preset)
    except (ValueError, FileNotFoundError, OSError) as error:
        raise UserError(
            f"--preset {preset}: no tokenizer loads from it ({errors.first_line(error)}): give "
            "a directory written by save_to_preset, or in Hugging Face's layout"
        ) from None
    if not isinstance(tokenizer, keras_hub.tokenizers.BytePairTokenizer):
        raise UserError(
            f"--preset {preset}: its tokenizer is a {type(tokenizer).__name__}, whose tokens do "
            "not spell the text's bytes, so the assistant's cannot be found among them; chats "
            "are prepared with byte-pair tokenizers (GPT-2's, Llama 3's, Qwen's) or bytes "
            "(leave --preset out)"
        )
    return tokenizer


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
