"""The Python standard library's own modules as text: real, offline, on every machine.

Its top-level modules (``*.py`` beside ``os.py``, found through ``sysconfig``), in
order of name; every tenth is held out as ``test``, the rest are ``train``. Text no
one here wrote, and the same on every machine with the same Python (3.11: 168
modules, 4.7 MB). Each byte is a token, ids 1 to 256 (0 pads), as
``datasets.prepare --text`` makes them with ``--tokenizer bytes``, and 257 (``END``)
ends a module: a model of them has 258 ids (``VOCAB_SIZE``).

``input_fn`` reads a language model's windows of a split (``datasets/text/windows.py``): the
modules end to end, each followed by ``END``, cut into windows of ``length`` bytes,
each with its next bytes as ``targets``; an in-memory source, read by index and
resumed exactly. In PREDICT it gives ``prompts``, so that ``--schedule predict``
continues them; an export takes strings (``text``), as bytes.
``bigram_bits_per_byte`` is the baseline a model must beat.

``functions`` are a classifier's examples: the source of each function (``def``) of
a few packages, labelled by its package (which package does this code come from?).
Written as JSON lines for ``datasets.prepare --text``:

    python3 -m datasets.stdlib --functions data/functions.jsonl

``chats`` are a fine-tuning's: a user turn that is a function's docstring, and an
assistant turn that is its source without the docstring, for the top-level modules'
functions that have one. Written for ``datasets.prepare --chat``:

    python3 -m datasets.stdlib --chats data/chats.jsonl

``pairs`` are a preference tuning's: the same docstrings as prompts, each with its
function chosen and a corrupted copy rejected (its body's lines shuffled, or its
body cut off halfway). Written for ``datasets.prepare --pairs``:

    python3 -m datasets.stdlib --pairs data/pairs.jsonl
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import sysconfig

import gin
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from datasets import pipeline
from datasets.text import input_fns, serving, windows
from trainer import InputParams, Mode, UserError, errors, whole_files


def modules(split: str) -> list[str]:
    """The paths of a split's modules: ``'train'``, or ``'test'`` (every tenth)."""
    root = sysconfig.get_paths()["stdlib"]
    found = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    if not found:
        raise UserError(f"no Python modules in {root}, the standard library sysconfig names")
    held_out = {"train": False, "test": True}[split]
    return [os.path.join(root, f) for i, f in enumerate(found) if (i % 10 == 9) == held_out]


def byte_ids(paths: list[str]) -> list[np.ndarray]:
    """Each file's bytes as token ids (byte + 1)."""
    found = []
    for path in paths:
        with open(path, "rb") as f:
            found.append(np.frombuffer(f.read(), np.uint8).astype(np.int64) + 1)
    return found


def bigram_bits_per_byte() -> dict[str, float]:
    """Add-one unigram and bigram models of ``train``, in bits per byte of ``test``."""
    train, test = (np.concatenate(byte_ids(modules(s))) - 1 for s in ("train", "test"))
    unigram = np.bincount(train, minlength=256) + 1.0
    pairs = np.zeros([256, 256]) + 1.0
    np.add.at(pairs, (train[:-1], train[1:]), 1.0)
    conditional = pairs / pairs.sum(axis=1, keepdims=True)
    return {
        "unigram": float(-np.log2(unigram[test] / unigram.sum()).mean()),
        "bigram": float(-np.log2(conditional[test[:-1], test[1:]]).mean()),
    }


_WINDOWS: dict = {}
END = 257  # after each module: a byte's id is its value + 1, 0 pads
VOCAB_SIZE = 258  # an Embedding's rows for these windows


@gin.configurable("stdlib.input_fn")
def input_fn(
    mode: Mode,
    params: InputParams,
    length: int = 128,
    prompts: tuple[str, ...] = ("def main(",),
) -> tf.data.Dataset:
    """A byte-level language model's batches of the standard library's modules.

    TRAIN: ``({'tokens': [b, length]}, {'targets': [b, length]})`` windows of
    ``train``, by index forever; EVAL: ``test``'s windows once; PREDICT: ``prompts``
    as ``{'tokens'}``, padded with 0, for a model that continues them.
    """
    errors.check_count("stdlib.input_fn.length", length)
    if mode == Mode.PREDICT:
        if isinstance(prompts, str) or not prompts:
            raise UserError(
                f"stdlib.input_fn.prompts must be a list of strings to continue, got "
                f"{prompts!r}: write ['def main(']"
            )
        ids = tf.ragged.constant([[b + 1 for b in p.encode()] for p in prompts], tf.int64)
        source = pipeline.ArraySource({"tokens": ids}, "prompts")
        dataset = pipeline.build(source, mode, params, lambda e: ({"tokens": e["tokens"]}, {}))
    else:
        split = "train" if mode == Mode.TRAIN else "test"
        if (split, length) not in _WINDOWS:  # read once a process
            tokens = byte_ids(modules(split))
            _WINDOWS[split, length] = windows.windows(tokens, length, f"stdlib-{split}", END)
        source = _WINDOWS[split, length]
        dataset = pipeline.build(
            source, mode, params, input_fns.next_tokens, name=f"stdlib-{split}"
        )
    # An export takes strings, the last ``length`` bytes of each continued.
    return serving.tokenized_by(dataset, serving.bytes_tokenizer(), length, keep_last=True)


PACKAGES = ("asyncio", "email", "http", "logging", "multiprocessing", "unittest", "urllib", "xml")
DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def ", re.M)


def functions(packages=PACKAGES, longest: int = 800) -> list[dict]:
    """``{'text': a function's source (its first ``longest`` characters), 'label': package}``.

    Every ``def`` of each package's modules (not their tests), in order of path: from
    its line to the next ``def``, dedented.
    """
    root = sysconfig.get_paths()["stdlib"]
    rows = []
    for package in packages:
        for path in _sources(os.path.join(root, package)):
            with open(path, encoding="utf-8", errors="replace") as f:
                source = f.read()
            starts = [m.start() for m in DEF.finditer(source)]
            for start, end in zip(starts, [*starts[1:], len(source)][: len(starts)], strict=True):
                lines = source[start:end].rstrip().splitlines()
                indent = len(lines[0]) - len(lines[0].lstrip())
                body = "\n".join(line[indent:] for line in lines)
                rows.append({"text": body[:longest], "label": package})
    return rows


def chats(longest: int = 400, longest_docstring: int = 200) -> list[dict]:
    """``{'messages': [user: a docstring, assistant: its function]}`` of the modules' functions.

    Each function (or method) of the top-level modules with a docstring and a body
    besides it, whose source without the docstring has at most ``longest``
    characters, and its docstring ``longest_docstring``; in order of module, then line.
    """
    found = []
    for split in ("train", "test"):
        for path in modules(split):
            with open(path, encoding="utf-8", errors="replace") as f:
                source = f.read()
            found += [(path, *pair) for pair in _documented(source, longest, longest_docstring)]
    return [
        {"messages": [{"role": "user", "content": doc}, {"role": "assistant", "content": code}]}
        for _, _, doc, code in sorted(found)
    ]


def pairs(seed: int = 0) -> list[dict]:
    """``{'prompt', 'chosen', 'rejected'}``: ``chats()``'s docstrings, each function chosen.

    Its rejected copy: every other one, its body's lines shuffled (the ``def`` line
    kept first); the rest, and those a shuffle leaves as they were, its body cut off
    halfway.
    """
    rng = np.random.default_rng(seed)
    found = []
    for i, chat in enumerate(chats()):
        doc, code = (turn["content"] for turn in chat["messages"])
        head, *body = code.split("\n")
        rejected = "\n".join([head, *rng.permutation(body)]) if i % 2 == 0 else code
        if rejected == code:
            rejected = code[: len(head) + 1 + (len(code) - len(head)) // 2]
        found.append({"prompt": doc, "chosen": code, "rejected": rejected})
    return found


def _documented(source: str, longest: int, longest_docstring: int):
    """``(line, docstring, source without it)`` of a module's documented functions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a module of another Python's syntax
        return []
    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) > longest_docstring:
            continue
        first, last = node.body[0].lineno, node.body[0].end_lineno  # the docstring's lines
        kept = lines[node.lineno - 1 : first - 1] + lines[last : node.end_lineno]
        code = "\n".join(line[node.col_offset :] for line in kept)
        if len(code) <= longest:
            found.append((node.lineno, doc, code))
    return found


def _sources(folder: str) -> list[str]:
    """The ``.py`` files under ``folder``, but its tests, sorted by path."""
    found = []
    for where, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d not in ("test", "tests", "__pycache__")]
        found += [os.path.join(where, f) for f in files if f.endswith(".py")]
    return sorted(found)


def main(argv: list[str]) -> int:
    """``--functions PATH``: writes ``functions()`` to PATH, as JSON lines or Parquet.

    Parquet (row groups of ``ROW_GROUP`` functions) when PATH ends in ``.parquet``.
    ``--chats PATH``, ``--pairs PATH``: writes ``chats()``, ``pairs()`` as JSON lines.
    """
    if len(argv) != 3 or argv[1] not in ("--functions", "--chats", "--pairs"):
        print(
            "usage: python3 -m datasets.stdlib --functions data/functions.jsonl\n"
            "       python3 -m datasets.stdlib --chats data/chats.jsonl\n"
            "       python3 -m datasets.stdlib --pairs data/pairs.jsonl",
            file=sys.stderr,
        )
        return 2
    if argv[1] in ("--chats", "--pairs"):
        os.makedirs(os.path.dirname(argv[2]) or ".", exist_ok=True)
        found = chats() if argv[1] == "--chats" else pairs()
        whole_files.write_atomically(argv[2], (json.dumps(row) + "\n" for row in found))
        what = (
            "a docstring and its function"
            if argv[1] == "--chats"
            else ("a docstring, its function chosen and a corrupted copy rejected")
        )
        print(f"{argv[2]}: {len(found):,} {argv[1][2:]}, {what} each")
        return 0
    rows = functions()
    os.makedirs(os.path.dirname(argv[2]) or ".", exist_ok=True)
    if argv[2].endswith(".parquet"):
        _write_parquet(argv[2], rows)
    else:
        whole_files.write_atomically(argv[2], (json.dumps(row) + "\n" for row in rows))
    counts = {p: sum(r["label"] == p for r in rows) for p in PACKAGES}
    print(f"{argv[2]}: {len(rows):,} functions of {len(counts)} packages ({counts})")
    return 0


ROW_GROUP = 1000  # functions per Parquet row group: 400 KB or so of text


def _write_parquet(path: str, rows: list[dict]) -> None:
    """``rows`` as one Parquet file, written beside ``path`` and renamed when whole."""
    table = pa.table({"text": [r["text"] for r in rows], "label": [r["label"] for r in rows]})
    partial = f"{path}.partial"
    try:
        pq.write_table(table, partial, row_group_size=ROW_GROUP)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):  # a failed write leaves nothing beside the file
            os.remove(partial)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
