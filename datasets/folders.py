"""A folder of image files, one subfolder per class, prepared as TFRecord shards.

Two layouts, as Keras's ``image_dataset_from_directory`` and torchvision's
``ImageFolder`` read them::

    DIR/train/CLASS/*.jpg  DIR/test/CLASS/*.jpg    (or val/, validation/)
    DIR/CLASS/*.jpg                                (--eval_fraction held out per class)

Class ids are the sorted names of the training classes, recorded in
``dataset.json`` with the names. Hidden files (``.DS_Store``) are passed over; every
other file is an image or is skipped and named (``datasets/records/writing.py``). The
training files are written in an order shuffled once, so that a reader in sequence
sees classes mixed; evaluation files keep their sorted order.
"""

from __future__ import annotations

import hashlib
import os
import random

from datasets.records import writing
from trainer import UserError

EVAL_FOLDERS = ("test", "validation", "val")  # the first one present is the eval split
SHUFFLE_SEED = 0x1A6E5  # the order the training files are written in
FILES_PER_SHARD = 1000  # without --shards


def layout(root: str, eval_fraction: float) -> tuple[dict[str, list], list[str]]:
    """``{split: [(path, class id)]}`` and the class names, from the folder's layout."""
    if not os.path.isdir(root):
        raise UserError(f"--images {root}: no such directory")
    subfolders = _subfolders(root)
    if "train" in subfolders:
        evals = [name for name in EVAL_FOLDERS if name in subfolders]
        if not evals:
            raise UserError(
                f"{root} has train/ but no {'/, '.join(EVAL_FOLDERS)}/ beside it: add one, "
                "or put the class folders directly in it and use --eval_fraction"
            )
        classes = _subfolders(os.path.join(root, "train"))
        splits = {name: _files(os.path.join(root, name), classes) for name in ["train", *evals]}
    else:
        classes = subfolders
        if not 0 < eval_fraction < 1:
            raise UserError(f"--eval_fraction must be between 0 and 1, got {eval_fraction}")
        splits = _held_out(_files(root, classes), eval_fraction, root)
    if not classes:
        raise UserError(f"{root} has no class subfolders: put each class's images in one")
    for split, items in splits.items():
        if not items:
            raise UserError(f"{root}: split {split!r} has no files")
    _check_every_class_trains(root, classes, splits["train"], "train" in subfolders)
    random.Random(SHUFFLE_SEED).shuffle(splits["train"])
    return splits, classes


def prepare(
    root: str,
    out_dir: str,
    num_shards: int | None,
    eval_fraction: float = 0.1,
    max_side: int | None = None,
) -> dict:
    """Writes the folder's splits to ``out_dir``; returns the ``dataset.json`` written."""
    splits, classes = layout(root, eval_fraction)
    metadata = writing.start(out_dir)
    eval_split = next(name for name in splits if name != "train")
    for split, items in splits.items():
        count = min(num_shards or -(-len(items) // FILES_PER_SHARD), len(items))
        plan = writing.plan_of([(os.path.relpath(p, root), c) for p, c in items], count, max_side)
        writing.write_described(
            out_dir, metadata, split, items, len(items), count, plan, classes, eval_split, max_side
        )
    return metadata


def _check_every_class_trains(root, classes, train, in_train_folder) -> None:
    """Refuses, by name, class folders without training files.

    Their ids would be labels no example has: torchvision's ImageFolder refuses such a
    folder too, Keras's image_dataset_from_directory keeps it silently.
    """
    counts = {label: 0 for label in range(len(classes))}
    for _, label in train:
        counts[label] += 1
    empty = [classes[label] for label, count in counts.items() if not count]
    if empty:
        where = os.path.join(root, "train") if in_train_folder else root
        folders = ", ".join(os.path.join(where, name) for name in empty)
        raise UserError(
            f"{folders}: no training images in this class folder, so the model would learn "
            "a class no example has; add its images or remove the folder"
        )


def _subfolders(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _files(root: str, classes: list[str]) -> list[tuple[str, int]]:
    """Every non-hidden file under each class folder, in sorted order."""
    items = []
    for label, name in enumerate(classes):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder):
            continue  # a class with no evaluation images
        for base, dirs, names in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            items.extend(
                (os.path.join(base, n), label) for n in sorted(names) if not n.startswith(".")
            )
    unknown = set(_subfolders(root)) - set(classes)
    if unknown:
        raise UserError(
            f"{root} has class folders that train/ has not: {', '.join(sorted(unknown))}; "
            "every class must have training images"
        )
    return items


def _held_out(items: list[tuple[str, int]], fraction: float, root: str) -> dict:
    """``{'train', 'test'}``: per class, the files whose name hashes lowest held out.

    A file's split depends on its own name only, not on which others are there.
    """
    by_class: dict[int, list] = {}
    for item in items:
        by_class.setdefault(item[1], []).append(item)
    train, test = [], []
    for members in by_class.values():
        ranked = sorted(members, key=lambda item: _digest(os.path.relpath(item[0], root)))
        held = round(fraction * len(ranked))
        test.extend(sorted(ranked[:held]))
        train.extend(ranked[held:])
    return {"train": train, "test": test}


def _digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()
