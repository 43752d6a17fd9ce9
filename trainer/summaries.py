"""What a run records: TensorBoard event files, and ``metrics.jsonl`` for scripts.

Every scalar written through ``Writers.scalars`` (the train log steps and every
evaluation) goes both to TensorBoard and, as one JSON line, to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import whole_files

METRICS = "metrics.jsonl"


class MetricsFile:
    """Every train log step and evaluation of a model_dir, one JSON line each.

    ``{"step": 200, "time": 1795400000.1, "writer": "train", "loss": 0.31, ...}``,
    where ``writer`` is the TensorBoard directory (``train``, ``eval_<name>``);
    ``pandas.read_json(path, lines=True)`` reads it. A training run holds its lines
    in memory until its first checkpoint (``start``), so a run that fails before
    then leaves the file as it was; a resumed run then drops the lines logged after
    the checkpoint it resumed from (they come again), so no step appears twice.
    """

    def __init__(self, model_dir: str):
        self.path = os.path.join(model_dir, METRICS)
        self.held: list[str] | None = None  # None: lines are appended as they come

    def resume(self, step: int) -> None:
        """A training run starts from ``step``: hold lines until it has really started."""
        kept, unreadable = [], []
        for number, line in enumerate(self._lines(), 1):
            record = _record(line)
            if record is None:
                unreadable.append(number)
            elif record["step"] <= step:
                kept.append(line)
        if unreadable:  # a line cut short by a kill, say: the others are still good
            logging.warning(
                "%s: dropped %d unreadable line(s), the first line %d; kept the other %d",
                self.path,
                len(unreadable),
                unreadable[0],
                len(kept),
            )
        self.held = kept

    def start(self) -> None:
        """The run really started: rewrite the file with the held lines (atomically)."""
        if self.held is not None:
            whole_files.write_atomically(self.path, self.held)
            self.held = None

    def append(self, writer: str, step: int, values: Mapping[str, float]) -> None:
        """Records ``values`` of TensorBoard directory ``writer`` at ``step``."""
        record = {"step": int(step), "time": round(time.time(), 3), "writer": writer}
        record.update({k: float(v) for k, v in values.items()})
        line = json.dumps(record) + "\n"
        if self.held is not None:
            self.held.append(line)
        elif "://" in self.path:  # object stores cannot append: rewrite
            whole_files.write_atomically(self.path, [*self._lines(), line])
        else:
            with open(self.path, "a") as f:
                f.write(line)

    def records(self, writer: str) -> list[dict]:
        """The records of TensorBoard directory ``writer``, oldest first (those held)."""
        lines = self._lines() if self.held is None else self.held
        found = [r for r in map(_record, lines) if r is not None and r.get("writer") == writer]
        return sorted(found, key=lambda r: r["step"])

    def _lines(self) -> list[str]:
        if not tf.io.gfile.exists(self.path):
            return []
        with tf.io.gfile.GFile(self.path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
        return [line + "\n" for line in text.splitlines() if line.strip()]


def _record(line: str) -> dict | None:
    """A metrics line as a dict with an integer step, or None when it is not one."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(record, dict) and isinstance(record.get("step"), int)
    return record if ok else None


class Writers:
    """Creates one ``tf.summary`` file writer per subdirectory of ``model_dir``, lazily."""

    def __init__(self, model_dir: str, tracker=None):
        self.model_dir = model_dir
        self._writers: dict[str, tf.summary.SummaryWriter] = {}
        self.metrics = MetricsFile(model_dir)
        self.tracker = tracker  # an experiment tracker taking the scalars too (tracking.py)

    def get(self, name: str) -> tf.summary.SummaryWriter:
        """The writer of ``model_dir/name`` (``train``, ``eval_test``, ...)."""
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(os.path.join(self.model_dir, name))
        return self._writers[name]

    def scalars(self, name: str, step: int, values: Mapping[str, float]) -> None:
        """Writes each value as a scalar under its key, at ``step`` (and to metrics.jsonl)."""
        self.metrics.append(name, step, values)
        if self.tracker is not None:
            self.tracker.record(name, step, values)
        writer = self.get(name)
        with writer.as_default(step=step):
            for key, value in values.items():
                tf.summary.scalar(key, value)
        writer.flush()

    def text(self, name: str, tag: str, text: str, step: int) -> None:
        """Writes ``text`` as a preformatted block (TensorBoard renders markdown)."""
        writer = self.get(name)
        block = "\n".join("    " + line for line in text.splitlines())
        with writer.as_default(step=step):
            tf.summary.text(tag, block)
        writer.flush()

    def histograms(self, name: str, step: int, variables) -> None:
        """One histogram per variable, named by its Keras path (``dense/dense_0/kernel``)."""
        writer = self.get(name)
        with writer.as_default(step=step):
            for v in variables:
                value = getattr(v, "value", v)  # Keras's property; tf.Variable's method
                value = value() if callable(value) else value
                tf.summary.histogram(getattr(v, "path", None) or v.name, value)
        writer.flush()

    def labelled_images(self, name: str, step: int, images, predicted, actual, max_images=8):
        """Input images with "predicted/true" written on them, red where they differ."""
        rendered = [
            _annotate(image, int(p), int(a))
            for image, p, a in list(zip(images, predicted, actual, strict=True))[:max_images]
        ]
        writer = self.get(name)
        with writer.as_default(step=step):
            tf.summary.image("labelled_inputs", np.stack(rendered), max_outputs=max_images)
        writer.flush()

    def images(self, name: str, step: int, tag: str, images, max_images: int = 8) -> None:
        """Images in [0, 1] (``[batch, height, width, channels]``), the first few."""
        writer = self.get(name)
        with writer.as_default(step=step):
            tf.summary.image(tag, np.clip(images[:max_images], 0.0, 1.0), max_outputs=max_images)
        writer.flush()

    def close(self) -> None:
        """Flushes and closes every writer."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def _annotate(image, predicted: int, actual: int, size: int = 96) -> np.ndarray:
    """An image scaled up to ``size`` pixels with "p:<predicted> t:<true>" drawn on it."""
    from PIL import Image, ImageDraw  # Pillow comes with tensorboard

    pixels = np.asarray(image, dtype=np.float32)
    if pixels.max() > 1.0 or pixels.min() < 0.0:  # standardised: stretch to [0, 1]
        pixels = (pixels - pixels.min()) / max(float(pixels.max() - pixels.min()), 1e-6)
    pixels = np.repeat(pixels, 3, axis=-1) if pixels.shape[-1] == 1 else pixels[..., :3]
    picture = Image.fromarray((pixels * 255).astype(np.uint8)).resize((size, size), Image.NEAREST)
    draw = ImageDraw.Draw(picture)
    colour = (0, 200, 0) if predicted == actual else (230, 0, 0)
    draw.rectangle([0, 0, size, 12], fill=(0, 0, 0))
    draw.text((2, 0), f"p:{predicted} t:{actual}", fill=colour)
    return np.asarray(picture, dtype=np.float32) / 255.0
