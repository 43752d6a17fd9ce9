"""``prepare --text``: a file of documents tokenized once into shards read by index.

The file is checked whole before anything is written (``writing.survey``), a
vocabulary learned if the tokenizer needs one, then the splits written a thousand
documents at a time (``writing.write_splits``) into a staging folder put in place
whole (``trainer/owned_dirs.py``), with ``dataset.json`` describing them.
"""

from __future__ import annotations

import functools
import os

from datasets.records import shards
from datasets.text import writing
from datasets.text.tokenizers import KEPT, Tokenizer
from trainer import errors, owned_dirs, whole_files


def prepare(
    path: str,
    out_dir: str,
    tokenizer: str = "bytes",
    vocab_size: int = 8000,
    text_field: str = "text",
    label_field: str | None = None,
    eval_fraction: float = 0.1,
    num_shards: int = 4,
    vocab: str | None = None,
) -> dict:
    """Tokenizes the file's documents and writes them as shards; returns ``dataset.json``.

    ``label_field``: the rows' field holding their class; None: 'label', if rows have it.

    ``out_dir`` must be new, empty, or prepared before (``trainer/owned_dirs.py``):
    written into a temporary directory beside it and put in place when whole, so a
    failure leaves it as it was, and only files prepare wrote are ever replaced.
    """
    owned_dirs.check(out_dir, shards.OWNER)
    writing.check_fraction(eval_fraction)
    errors.check_count("--shards", num_shards)
    named, label_field = label_field is not None, label_field or "label"
    found = writing.survey(path, text_field, label_field, named)
    documents = functools.partial(writing.chunks, path, text_field, label_field)
    tokens = Tokenizer.learned(tokenizer, (t for t, _ in documents()), vocab_size, vocab)
    staging = owned_dirs.staging(out_dir, shards.OWNER)
    try:
        splits = writing.write_splits(
            staging,
            documents(),
            tokens.all_ids,
            found,
            eval_fraction,
            num_shards,
            tokens.vocab_size + 1,
            tokens.vocab_size,  # the id after the tokenizer's ends a document
        )
        _write_description(staging, tokens, found, splits)
        owned_dirs.put_in_place(staging, out_dir, shards.OWNER)
    finally:
        owned_dirs.discard(staging)
    return shards.read_metadata(out_dir)


def _write_description(staging: str, tokens: Tokenizer, found, splits: dict) -> None:
    """Writes the kept vocabulary and ``dataset.json`` of the prepared text."""
    classes = found.classes
    metadata = {
        "kind": "text",
        "tokenizer": tokens.kind,
        "vocab_size": tokens.vocab_size + 1,  # the end of a document's id last
        "end_of_document": tokens.vocab_size,
        "num_classes": len(classes),
        "classes": classes,
        "source": os.path.basename(found.path),
        "compression": None,
        "eval_split": "test" if "test" in splits else "train",
        "splits": splits,
    }
    if tokens.kind in KEPT:
        with open(os.path.join(staging, KEPT[tokens.kind]), "wb") as f:
            kept = tokens.vocabulary
            f.write(kept if isinstance(kept, bytes) else ("\n".join(kept) + "\n").encode())
    whole_files.write_json(os.path.join(staging, shards.METADATA), metadata)
