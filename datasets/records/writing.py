"""Writing encoded images as TFRecord shards: streamed, on every core, resumable.

``write_split`` takes a split's items (an image file's path, or encoded bytes, and
a class id) and writes them as ``num_shards`` shards of ``tf.train.Example``
records, ``image`` (the encoded bytes) and ``label``. Each image is checked by
decoding it once: a file that is not a readable image is skipped, named in the log,
and counted at the end; one bad file in a million costs nothing but its line.
JPEG and PNG bytes are kept as they are; other formats (GIF, BMP, WebP) are stored
as PNG, losslessly; with ``max_side`` a larger image is resized once, here, so that
training decodes fewer pixels.

Memory does not grow with the data: shards are written one after the other, the
images of a shard checked by a pool of threads (TensorFlow's decoders release the
GIL) through a window of bounded size. A shard is written under a temporary name and
renamed when whole; ``SPLIT.progress.json`` lists the shards done, so that the same
command run again after a kill writes only what is missing. ``dataset.json`` names
a split only once all its shards are written.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf
from absl import logging

from datasets import images
from datasets.records import indexed, shards
from trainer import UserError, console, errors, owned_dirs, whole_files

JPEG_QUALITY = 90  # of images resized by max_side (ImageNet's own JPEGs are ~90)
LINES_FROM = 1000  # images between progress lines off a terminal, at least


@dataclasses.dataclass
class Checked:
    """One image ready to be written, or why it is not."""

    data: bytes = b""
    encoding: str = ""  # jpeg or png
    shape: tuple[int, int, int] = (0, 0, 0)
    problem: str = ""


def encoding_of(data: bytes) -> str:
    """The format of encoded image bytes, by their signature (not a file name)."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"GIF8":
        return "gif"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return ""


def check(source: str | bytes, max_side: int | None = None) -> Checked:
    """An image's bytes as they will be stored, after decoding it once to check it."""
    try:
        if isinstance(source, str):
            with open(source, "rb") as f:
                data = f.read()
        else:
            data = source
        encoding = encoding_of(data)
        if not encoding:
            return Checked(problem="not an image (no JPEG, PNG, GIF, BMP or WebP signature)")
        image = tf.io.decode_image(data, expand_animations=False)
    except (OSError, tf.errors.OpError) as error:
        return Checked(problem=_reason(error))
    height, width, channels = image.shape
    if max_side and max(height, width) > max_side:
        scale = max_side / max(height, width)
        size = [max(1, round(height * scale)), max(1, round(width * scale))]
        image = tf.cast(tf.round(tf.image.resize(image, size, antialias=True)), tf.uint8)
        height, width = size
        encoding = "jpeg" if encoding == "jpeg" else "png"
        data = _encode(image, encoding)
    elif encoding not in ("jpeg", "png"):
        encoding, data = "png", _encode(image, "png")
    return Checked(data, encoding, (height, width, 1 if channels in (1, 2) else 3))


def start(out_dir: str) -> dict:
    """The ``dataset.json`` of ``out_dir`` so far (``{}`` if new); refuses other data.

    A folder that holds files prepare did not write is refused (``shards.OWNER``).
    """
    owned_dirs.check(out_dir, shards.OWNER)
    os.makedirs(out_dir, exist_ok=True)
    metadata = shards.read_metadata(out_dir, missing_ok=True) or {}
    if metadata and metadata.get("image_format") != images.ENCODED:
        raise UserError(
            f"{out_dir} holds data prepared as {metadata.get('image_format')} images: "
            "choose another --out"
        )
    return metadata


def write_described(
    out_dir: str,
    metadata: dict,
    split: str,
    items,
    count: int,
    num_shards: int,
    plan: str,
    classes: list[str],
    eval_split: str,
    max_side: int | None = None,
    names: Callable[[int], str] | None = None,
) -> None:
    """Writes a split (``write_split``) unless written already, then its description."""
    if written(out_dir, metadata, split, plan):
        logging.info("%s: already written in %s", split, out_dir)
        return
    logging.info("%s: %d images, %d classes, %d shards", split, count, len(classes), num_shards)
    entry = write_split(
        out_dir, split, items, count, num_shards, max_side=max_side, plan=plan, names=names
    )
    describe(metadata, split, entry, classes, eval_split)
    whole_files.write_json(os.path.join(out_dir, shards.METADATA), metadata)
    if entry["skipped"]:
        logging.warning(
            "%s: skipped %d of %d files that are not readable images (named above)",
            split,
            entry["skipped"],
            count,
        )


def write_split(
    out_dir: str,
    split: str,
    items: Sequence[tuple[str | bytes, int]] | Callable[[int, int], Iterable],
    count: int,
    num_shards: int,
    *,
    max_side: int | None = None,
    plan: str = "",
    names: Callable[[int], str] | None = None,
) -> dict:
    """Writes ``count`` items as shards of ``split``; returns its ``dataset.json`` entry.

    Args:
      out_dir: the prepared directory.
      split: the split's name.
      items: ``(path or encoded bytes, class id)`` pairs, or a function of
        ``(start, stop)`` giving those of a range (a source read in slices).
      count: how many items there are.
      num_shards: shards to write; shard k holds the k-th contiguous block.
      max_side: resize images whose longer side exceeds it.
      plan: ``plan_of`` what was asked; a rerun resumes only the same plan.
      names: item number -> a name for the log (default: the path).
    """
    progress_path = os.path.join(out_dir, f"{split}.progress.json")
    done = whole_files.read_json(progress_path) or {}
    if done.get("plan") != plan:
        done = {"plan": plan, "shards": {}}
    bounds = np.linspace(0, count, num_shards + 1).astype(int)
    bar = _Progress(split, count, sum(e["items"] for e in done["shards"].values()))
    for index in range(num_shards):
        entry = done["shards"].get(str(index))
        path = os.path.join(out_dir, shards.shard_name(split, index, num_shards, None))
        if entry and _whole(path, entry):
            continue
        start, stop = int(bounds[index]), int(bounds[index + 1])
        chunk = items(start, stop) if callable(items) else items[start:stop]
        name_of = names or (lambda i, c=chunk, s=start: str(c[i - s][0]))
        done["shards"][str(index)] = _write_shard(path, chunk, start, max_side, name_of, bar)
        whole_files.write_json(progress_path, done)
    bar.close()
    entry = _entry(done["shards"], num_shards)
    entry["plan"] = plan
    tf.io.gfile.remove(progress_path)
    return entry


def describe(metadata: dict, split: str, entry: dict, classes: list[str], eval_split: str):
    """Adds a written split to ``metadata``, as ``datasets/images.py`` reads it."""
    same = "image_shape" not in metadata or metadata["image_shape"] == entry["image_shape"]
    metadata.setdefault("splits", {})[split] = {
        k: entry[k] for k in ("shards", "count", "skipped", "encodings", "plan")
    }
    metadata.update(
        image_format=images.ENCODED,
        image_shape=entry["image_shape"] if same else None,
        channels=max(metadata.get("channels", 1), entry["channels"]),
        compression=None,
        num_classes=len(classes),
        class_names=classes,
        eval_split=eval_split,
    )


def written(out_dir: str, metadata: dict, split: str, plan: str) -> bool:
    """Whether ``split`` was written whole from the same files and options."""
    entry = metadata.get("splits", {}).get(split)
    if not entry or entry.get("plan") != plan:
        return False
    return all(
        os.path.exists(os.path.join(out_dir, s["file"]))
        and os.path.getsize(os.path.join(out_dir, s["file"])) == s["bytes"]
        for s in entry["shards"]
    )


def plan_of(*parts) -> str:
    """A digest of what a split is written from and how (sources, shards, options)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _write_shard(path, chunk, start, max_side, name_of, bar) -> dict:
    """Writes one shard from its items, checked in parallel; returns its summary."""
    offsets, offset, skipped = [], 0, []
    encodings: collections.Counter = collections.Counter()
    shapes, channels = set(), 1
    with tf.io.TFRecordWriter(path + ".tmp") as writer:
        for number, (checked, label) in enumerate(_checked(chunk, max_side), start):
            bar.advance()
            if checked.problem:
                skipped.append(f"{name_of(number)}: {checked.problem}")
                logging.warning("Skipping %s", skipped[-1])
                continue
            record = _example(checked.data, label)
            writer.write(record)
            offsets.append(offset)
            offset += indexed.HEADER + len(record) + 4
            encodings[checked.encoding] += 1
            shapes.add(checked.shape[:2])
            channels = max(channels, checked.shape[2])
    tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
    indexed.write_index(path, np.asarray(offsets, np.int64))
    return {
        "file": os.path.basename(path),
        "count": len(offsets),
        "bytes": tf.io.gfile.stat(path).length,
        "items": len(offsets) + len(skipped),
        "skipped": skipped,
        "encodings": dict(encodings),
        "shape": list(shapes.pop()) if len(shapes) == 1 else None,
        "channels": channels,
    }


def _checked(chunk: Iterable, max_side: int | None):
    """``(Checked, label)`` of each item, in order, checked by a pool of threads."""
    workers = os.cpu_count() or 1
    window: collections.deque = collections.deque()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for source, label in chunk:
            window.append((pool.submit(check, source, max_side), int(label)))
            if len(window) >= 4 * workers:
                future, label_ = window.popleft()
                yield future.result(), label_
        while window:
            future, label_ = window.popleft()
            yield future.result(), label_


def _entry(done: dict, num_shards: int) -> dict:
    """The split's ``dataset.json`` entry from its shards' summaries."""
    parts = [done[str(i)] for i in range(num_shards)]
    encodings: collections.Counter = collections.Counter()
    for part in parts:
        encodings.update(part["encodings"])
    shapes = {tuple(p["shape"]) if p["shape"] else None for p in parts if p["count"]}
    skipped = [line for part in parts for line in part["skipped"]]
    channels = max(p["channels"] for p in parts)
    one_shape = len(shapes) == 1 and None not in shapes
    return {
        "shards": [{k: p[k] for k in ("file", "count", "bytes")} for p in parts],
        "count": sum(p["count"] for p in parts),
        "skipped": len(skipped),
        "encodings": dict(encodings),
        "image_shape": [*shapes.pop(), channels] if one_shape else None,
        "channels": channels,
    }


def _whole(path: str, entry: dict) -> bool:
    return tf.io.gfile.exists(path) and tf.io.gfile.stat(path).length == entry["bytes"]


def _example(data: bytes, label: int) -> bytes:
    feature = {
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
    }
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    return example.SerializeToString(deterministic=True)  # the same bytes on a rerun


def _encode(image: tf.Tensor, encoding: str) -> bytes:
    if encoding == "jpeg":
        return tf.io.encode_jpeg(image, quality=JPEG_QUALITY).numpy()
    return tf.io.encode_png(image).numpy()


def _reason(error: Exception) -> str:
    if isinstance(error, tf.errors.OpError):
        return errors.op_error_text(error)
    return errors.first_line(error)


class _Progress:
    """A bar with images per second on a terminal; elsewhere a line per 10% of many."""

    def __init__(self, split: str, total: int, start: int):
        self.total, self.n, self.split = total, start, split
        terminal = sys.stdout.isatty()
        large = total >= 10_000  # 96.0k/1.28M, but 32/164 rather than 32.0/164
        self.bar = console.ProgressBar(start, total, split, "img", large) if terminal else None
        self.next_line = start + max(LINES_FROM, total // 10)

    def advance(self) -> None:
        self.n += 1
        if self.bar is not None:
            if self.n % 32 == 0 or self.n == self.total:
                self.bar.update(self.n)
        elif self.n >= self.next_line:
            logging.info("%s: %d of %d images", self.split, self.n, self.total)
            self.next_line += max(LINES_FROM, self.total // 10)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.n)
            self.bar.close()
