"""Folders of generated image files as users hold them: odd sizes, odd formats, a broken one.

Each class has its own brightness, so that a model can see it in colour and in
grayscale alike: class k's pixels are brighter the higher k is, in coloured noise.
"""

import io
import os

import numpy as np
from PIL import Image

CLASSES = ("at dusk", "daylight", "snow")  # sorted: ids 0, 1, 2, darkest first


def picture(label, rng, size=None):
    """uint8 [h, w, 3]: coloured noise, brighter for a higher class id."""
    height, width = size or rng.integers(24, 72, size=2)
    return (rng.integers(0, 80, (height, width, 3)) + 85 * label).astype(np.uint8)


def encoded(image, kind):
    """The bytes of ``image`` saved as ``kind``: jpeg, png, gray (JPEG), cmyk (JPEG), bmp."""
    buffer = io.BytesIO()
    picture_ = Image.fromarray(image)
    if kind == "gray":
        picture_.convert("L").save(buffer, "JPEG")
    elif kind == "cmyk":
        picture_.convert("CMYK").save(buffer, "JPEG")
    else:
        picture_.save(buffer, {"jpeg": "JPEG", "png": "PNG", "bmp": "BMP"}[kind])
    return buffer.getvalue()


def make(root, per_class=20, seed=0, split_folders=("train", "test"), broken=True):
    """Writes a folder of images; returns the relative paths of the files that are broken.

    ``split_folders`` empty: class folders directly in ``root``. Every tenth file is
    grayscale, CMYK, a PNG named ``.jpg`` or a BMP in turn; names have spaces and
    capital extensions; one training file is truncated, one is text named ``.jpg``.
    """
    rng = np.random.default_rng(seed)
    kinds = ["gray", "cmyk", "png", "bmp"]
    broken_files = []
    for split in split_folders or [""]:
        count = per_class if split in ("train", "") else max(2, per_class // 4)
        for label, name in enumerate(CLASSES):
            folder = os.path.join(root, split, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                kind = kinds[(i // 10) % 4] if i % 10 == 9 else "jpeg"
                ext = {"bmp": ".bmp"}.get(kind, ".JPEG" if i % 2 else ".jpg")
                with open(os.path.join(folder, f"img {i:03d}{ext}"), "wb") as f:
                    f.write(encoded(picture(label, rng), kind))
    if broken:
        first = split_folders[0] if split_folders else ""
        folder = os.path.join(root, first, CLASSES[0])
        whole = encoded(picture(0, rng, (50, 60)), "jpeg")
        with open(os.path.join(folder, "cut short.jpg"), "wb") as f:
            f.write(whole[: len(whole) // 2])
        with open(os.path.join(folder, "notes.jpg"), "w") as f:
            f.write("not an image\n")
        with open(os.path.join(folder, ".DS_Store"), "wb") as f:
            f.write(b"\0\0\0\1Bud1")
        broken_files = [os.path.join(first, CLASSES[0], n) for n in ("cut short.jpg", "notes.jpg")]
    return broken_files
