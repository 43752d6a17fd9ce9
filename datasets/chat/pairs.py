"""``prepare --pairs``: preference pairs, a prompt with a chosen and a rejected answer.

A row holds ``prompt``, ``chosen`` and ``rejected``, as TRL's preference datasets
keep them: each a string (the prompt the user's, an answer the assistant's), or a
list of ``{role, content}`` turns (the prompt a chat without its answer, each answer
the assistant's turns that follow it). JSON lines, Parquet or a ``save_to_disk``
folder, read in place.

Each pair is rendered twice by the chat template, the prompt followed by each
answer, and tokenized (``preparation.tokens_and_masks``: by bytes, or the tokenizer
of ``--preset``): a record holds
``chosen`` and ``rejected``, each chat's ids, and ``chosen_mask`` and
``rejected_mask``, 1 where the answer's tokens are: what a preference loss sums each
answer's log-probabilities over. The lengths kept are each pair's longer chat.

Refused in one line, naming the file and the pair, before anything is in place: a
pair whose answers are the same (it teaches no preference), and what a chat is
refused for (roles out of order, an empty answer).
"""

from __future__ import annotations

import json

import numpy as np

from datasets.chat import preparation, tokenizing
from datasets.tables import columns, source
from datasets.text import writing
from trainer import UserError

FIELDS = ("prompt", "chosen", "rejected")
ROLES = ("user", "assistant", "assistant")  # whose turn a field of text is


def prepare(
    path: str,
    out_dir: str,
    template: str = "chatml",
    eval_fraction: float = 0.1,
    num_shards: int = 4,
    preset: str | None = None,
) -> dict:
    """Renders, tokenizes and writes the pairs of ``path``; returns ``dataset.json``.

    ``preset``: a keras-hub preset whose tokenizer makes the ids (None: bytes).
    """
    chat_template = preparation.checked(
        path, out_dir, template, eval_fraction, num_shards, "--pairs"
    )
    tokenizer = tokenizing.tokenizer_of(preset)
    rows = source.rows_of(path, kinds_of(path), keep_index=False)
    features = (
        (pair_features(chat_template, tokenizer, *pair, f"{path}, pair {number + 1}"),)
        for number, pair in enumerate(read(rows))
    )

    def described(splits: dict) -> dict:
        found = preparation.description(chat_template, tokenizer, path, "prompt", splits)
        return found | {"kind": "pairs", "field": list(FIELDS)}

    return preparation.write_prepared(
        out_dir,
        len(rows),
        eval_fraction,
        lambda staging, split, count: PairWriter(staging, split, count, num_shards, tokenizer),
        features,
        chat_template,
        described,
    )


class PairWriter(writing.SplitWriter):
    """A split's pairs: their records and lengths (each pair's longer chat), no stream."""

    def __init__(
        self,
        out_dir: str,
        split: str,
        count: int,
        num_shards: int,
        tokenizer: tokenizing.Bytes | tokenizing.Preset,
    ):
        super().__init__(
            out_dir,
            split,
            count,
            num_shards,
            tokenizer.vocab_size,
            tokenizer.end,
            stream=False,  # a language model's windows are documents', not pairs'
        )

    def add(self, features: dict[str, np.ndarray]) -> None:  # type: ignore[override]
        """Writes one pair's record."""
        longer = max(len(features["chosen"]), len(features["rejected"]))
        self.record(writing.features_bytes(features), longer)


def kinds_of(path: str) -> dict[str, str]:
    """Each field's kind, by the source's types: chat messages, or text."""
    schema = source.rows_of(path, {}, keep_index=False).schema
    found = {}
    for field in FIELDS:
        index = schema.get_field_index(field)
        messages = index >= 0 and columns.is_messages(schema.field(index).type)
        found[field] = "messages" if messages else "text"
    return found


def read(rows):
    """Each row's ``(prompt, chosen, rejected)``, as chats: lists of turns."""
    kinds = [rows.columns[field] for field in FIELDS]
    for start in range(0, len(rows), writing.CHUNK):
        values, problem = rows._read(np.arange(start, min(start + writing.CHUNK, len(rows))))
        if problem:
            raise UserError(problem)
        for row in zip(*values, strict=True):
            yield tuple(map(_turns, row, kinds, ROLES))


def _turns(value, kind: str, role: str) -> list[dict]:
    text = value.decode() if isinstance(value, bytes) else value
    return json.loads(text) if kind == "messages" else [{"role": role, "content": text}]


def pair_features(
    template, tokenizer, prompt, chosen, rejected, where: str
) -> dict[str, np.ndarray]:
    """A pair's record: each answer after the prompt, rendered, tokenized, with its mask."""
    if chosen == rejected:
        raise UserError(
            f"{where}: the chosen and rejected answers are the same, so the pair prefers "
            "nothing: drop it, or give the answer it is preferred to"
        )
    answers = {"chosen": chosen, "rejected": rejected}
    chats = [(prompt + answer, f"{where} ({name})") for name, answer in answers.items()]
    made = preparation.tokens_and_masks(template, tokenizer, chats)
    found = {}
    for name, (ids, mask) in zip(answers, made, strict=True):
        found[name], found[f"{name}_mask"] = ids, mask
    return found
