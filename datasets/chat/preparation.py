"""``prepare --chat``: chats rendered by a template once, into shards read by index.

Each row's ``messages`` (JSON lines, Parquet or a ``save_to_disk`` folder, read in
place as ``datasets/tables`` reads them) is rendered by the chat template
(``templates.template_of``) and tokenized by bytes, or by a keras-hub model's own
tokenizer (``--preset``: ``tokenizing``). A record holds the chat's ``tokens`` and its
``mask``: 1 for each token of an assistant's ``{% generation %}`` span, what a loss
over the assistant's tokens counts. Each chat ends with the end-of-document id (the
tokenizer's end token), marked when the last turn is the assistant's: a model learns
where an answer stops (and ``LanguageModel.eos`` stops generating there).

Beside each split's shards and lengths (as ``prepare --text`` writes them) lies
``<split>-answers.npy``: where each chat's first assistant token is, so that a length
that would cut every answer off is refused before training, and a prompt can be read
without its answer. The template's text is kept as ``chat_template.jinja``, so the
prompts of a later generation are rendered as the training chats were.

Every chat is checked as it is written (roles in order, a non-empty answer inside
the template's spans); a refusal names the file and the row, and the output folder is
left as it was (``trainer/owned_dirs.py``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import numpy as np

from datasets.chat import templates, tokenizing
from datasets.records import shards
from datasets.tables import source
from datasets.text import writing
from trainer import UserError, errors, owned_dirs, whole_files

ANSWERS = "-answers.npy"  # beside the shards: each chat's first assistant token, by row


def prepare(
    path: str,
    out_dir: str,
    template: str = "chatml",
    field: str = "messages",
    eval_fraction: float = 0.1,
    num_shards: int = 4,
    preset: str | None = None,
) -> dict:
    """Renders, tokenizes and writes the chats of ``path``; returns ``dataset.json``.

    ``template``: 'chatml', a Hugging Face-layout model directory or a Jinja file.
    ``eval_fraction`` of the chats, spread evenly, are the ``test`` split. ``preset``:
    a keras-hub preset whose tokenizer makes the ids (None: bytes).
    """
    chat_template = checked(path, out_dir, template, eval_fraction, num_shards, "--chat")
    tokenizer = tokenizing.tokenizer_of(preset)
    rows = source.rows_of(path, {field: "messages"}, keep_index=False)

    def chats():
        number = 0
        for chunk in source.chunks(rows, field, writing.CHUNK):
            said = [(json.loads(c), f"{path}, chat {number + i + 1}") for i, c in enumerate(chunk)]
            yield from tokens_and_masks(chat_template, tokenizer, said)
            number += len(chunk)

    return write_prepared(
        out_dir,
        len(rows),
        eval_fraction,
        lambda staging, split, count: ChatWriter(staging, split, count, num_shards, tokenizer),
        chats(),
        chat_template,
        lambda splits: description(chat_template, tokenizer, path, field, splits),
    )


def checked(
    path: str, out_dir: str, template: str, eval_fraction: float, num_shards: int, flag: str
) -> templates.ChatTemplate:
    """The template, once ``prepare``'s arguments are found sound; refusals in one line."""
    owned_dirs.check(out_dir, shards.OWNER)
    writing.check_fraction(eval_fraction)
    errors.check_count("--shards", num_shards)
    chat_template = templates.template_of(template)
    if not os.path.exists(path):
        raise UserError(f"{flag} {path}: no such file or folder")
    return chat_template


def write_prepared(
    out_dir: str,
    count: int,
    eval_fraction: float,
    writer_of: Callable[[str, str, int], writing.SplitWriter],
    examples: Iterable[tuple],
    template: templates.ChatTemplate,
    described: Callable[[dict], dict],
) -> dict:
    """Writes ``count`` ``examples`` into the splits, the template and ``dataset.json``.

    Each example is the arguments of its split's writer's ``add`` (``writer_of(staging,
    split, count)``); ``described(splits)`` is ``dataset.json``. Written into a staging
    folder put in place whole (``trainer/owned_dirs.py``): a refusal while writing
    leaves ``out_dir`` as it was.
    """
    held = writing.held_out(eval_fraction)
    tested = held.count(count)
    staging = owned_dirs.staging(out_dir, shards.OWNER)
    try:
        writers = {
            split: writer_of(staging, split, size)
            for split, size in (("train", count - tested), ("test", tested))
            if size
        }
        for number, example in enumerate(examples):
            writers["test" if held(number) else "train"].add(*example)
        splits = {split: writer.close() for split, writer in writers.items()}
        with open(os.path.join(staging, templates.JINJA), "w", encoding="utf-8") as f:
            f.write(template.source)
        whole_files.write_json(os.path.join(staging, shards.METADATA), described(splits))
        owned_dirs.put_in_place(staging, out_dir, shards.OWNER)
    finally:
        owned_dirs.discard(staging)
    return shards.read_metadata(out_dir)


def tokens_and_masks(
    template: templates.ChatTemplate,
    tokenizer: tokenizing.Bytes | tokenizing.Preset,
    chats: list[tuple[list[dict], str]],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each chat's ids and assistant mask, then the end id (marked after an answer).

    ``chats``: each chat's turns and where it is, for a refusal.
    """
    rendered = [template.render(messages, where=where) for messages, where in chats]
    found = []
    made = tokenizer.ids_and_masks(rendered)
    for (messages, where), (ids, mask) in zip(chats, made, strict=True):
        if not mask.any():
            raise UserError(
                f"{where}: the chat has no assistant turn, so there is nothing to learn from "
                "it: drop it, or end it with the answer"
            )
        ends = messages[-1]["role"] == "assistant"
        found.append((np.append(ids, tokenizer.end), np.append(mask, ends).astype(np.int64)))
    return found


class ChatWriter(writing.SplitWriter):
    """A split's chats: ``SplitWriter``'s files, and where each one's answer starts."""

    def __init__(
        self,
        out_dir: str,
        split: str,
        count: int,
        num_shards: int,
        tokenizer: tokenizing.Bytes | tokenizing.Preset,
    ):
        super().__init__(out_dir, split, count, num_shards, tokenizer.vocab_size, tokenizer.end)
        self.answers: list[int] = []

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:  # type: ignore[override]
        """Writes one chat's ids and mask."""
        super().add(ids, None, mask)
        self.answers.append(int(np.argmax(mask)))

    def close(self) -> dict:
        """The split's entry, with its answers' starts."""
        entry = super().close()
        name = f"{self.split}{ANSWERS}"
        np.save(os.path.join(self.out_dir, name), np.asarray(self.answers, np.int32))
        return entry | {"answers": name}


def description(
    template: templates.ChatTemplate,
    tokenizer: tokenizing.Bytes | tokenizing.Preset,
    path: str,
    field: str,
    splits: dict,
) -> dict:
    """``dataset.json`` of prepared chats."""
    return {
        "kind": "chat",
        **tokenizer.described(),
        "chat_template": templates.JINJA,
        "template_from": template.name,
        "field": field,
        "num_classes": 0,
        "classes": [],
        "source": os.path.basename(os.path.normpath(path)),
        "compression": None,
        "eval_split": "test" if "test" in splits else "train",
        "splits": splits,
    }


def check_prepared(metadata: dict, data_dir: str, kind: str = "chat") -> None:
    """Refuses a prepared folder that does not hold chats (or ``kind``), in one line."""
    if metadata.get("kind") != kind:
        said = {"chat": "chats", "pairs": "preference pairs"}[kind]
        flag = {"chat": "--chat", "pairs": "--pairs"}[kind]
        raise UserError(
            f"{data_dir} holds {metadata.get('kind', 'images')}, not {said}: prepare them with "
            f"`python3 -m datasets.prepare {flag} FILE --out DIR`"
        )


def answer_starts(data_dir: str, entry: dict) -> np.ndarray:
    """Each chat's first assistant token of a split, by row, as prepare kept them."""
    path = os.path.join(data_dir, entry["answers"])
    try:
        found = np.load(path, allow_pickle=False)
    except Exception:  # missing, or a damaged header
        found = None
    if not (isinstance(found, np.ndarray) and found.shape == (entry["count"],)):
        raise UserError(
            f"{path} does not hold where the answers of the {entry['count']:,} chats "
            "dataset.json lists start: re-copy it with the shards, or prepare the chats again"
        )
    return found.astype(np.int64)
