"""TensorBoard event files: one writer per directory, scalars and text."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import tensorflow as tf


class Writers:
    """Creates one ``tf.summary`` file writer per subdirectory of ``model_dir``, lazily."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._writers: dict[str, tf.summary.SummaryWriter] = {}

    def get(self, name: str) -> tf.summary.SummaryWriter:
        """The writer of ``model_dir/name`` (``train``, ``eval_test``, ...)."""
        if name not in self._writers:
            self._writers[name] = tf.summary.create_file_writer(os.path.join(self.model_dir, name))
        return self._writers[name]

    def scalars(self, name: str, step: int, values: Mapping[str, float]) -> None:
        """Writes each value as a scalar under its key, at ``step``."""
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
