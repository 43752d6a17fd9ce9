"""The callbacks' state kept beside the checkpoints, so that a resumed run takes it back.

A callback's state is its attributes that are data (EarlyStopping's ``wait`` and
``best``, a CSVLogger's columns): ``of`` reads them, ``changed`` keeps what differs
from the state it began with, and ``write`` keeps them in
``model_dir/callbacks/<step>.npz`` (arrays as arrays, the rest as JSON), dropping the
steps no checkpoint needs any more. ``read`` gives back the newest up to a step.
``trainer.callbacks`` decides when.

Cost: one small file per checkpoint and per epoch; a callback that holds the model's
weights (``restore_best_weights``) writes them each time.
"""

import io
import json
import os

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import checkpoints, whole_files

STATE_DIR = "callbacks"  # in model_dir: each callback's state, as of a step
_SET_BY_THE_FRAMEWORK = ("model", "params", "_model", "_params")


def of(callback) -> dict:
    """A callback's attributes that are data (numbers, strings, arrays, lists of them)."""
    return {
        name: value
        for name, value in vars(callback).items()
        if name not in _SET_BY_THE_FRAMEWORK and _is_data(value)
    }


def changed(state: dict, fresh: dict) -> dict:
    """What in ``state`` differs from the callback's state once begun (its config does not)."""
    return {k: v for k, v in state.items() if k not in fresh or not same(v, fresh[k])}


def same(a, b) -> bool:
    """Whether two states (or configs) are equal, arrays by value and type."""
    if isinstance(a, np.ndarray | np.generic) or isinstance(b, np.ndarray | np.generic):
        return type(a) is type(b) and np.array_equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _is_data(value) -> bool:
    if value is None or isinstance(value, bool | int | float | str | np.generic | np.ndarray):
        return True
    if isinstance(value, list | tuple):
        return all(_is_data(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_data(v) for k, v in value.items())
    return False


def write(model_dir: str, step: int, state: dict) -> None:
    """``state`` to ``model_dir/callbacks/<step>.npz``: arrays as arrays, the rest as JSON."""
    arrays: dict[str, np.ndarray] = {}

    def encode(value):
        if isinstance(value, np.ndarray | np.generic):
            name = f"a{len(arrays)}"
            arrays[name] = np.asarray(value)
            return {"__array__": name}
        if isinstance(value, list | tuple):
            return [encode(v) for v in value]
        if isinstance(value, dict):
            return {k: encode(v) for k, v in value.items()}
        return value

    text = json.dumps(encode(state))
    buffer = io.BytesIO()
    np.savez(buffer, __json__=np.array(text), **arrays)
    directory = os.path.join(model_dir, STATE_DIR)
    tf.io.gfile.makedirs(directory)
    whole_files.write_atomically(os.path.join(directory, f"{step}.npz"), buffer.getvalue())
    kept = [checkpoints.step_of(p) for p in checkpoints.all_checkpoints(model_dir)]
    for old in _saved_steps(directory):
        if kept and old < min(kept) and old != step:
            tf.io.gfile.remove(os.path.join(directory, f"{old}.npz"))


def _saved_steps(directory: str) -> list[int]:
    if not tf.io.gfile.isdir(directory):
        return []
    names = tf.io.gfile.listdir(directory)
    return sorted(int(n[:-4]) for n in names if n.endswith(".npz") and n[:-4].isdigit())


def read(model_dir: str, step: int) -> dict:
    """The callbacks' state kept at the newest step up to ``step`` ({} if none)."""
    directory = os.path.join(model_dir, STATE_DIR)
    steps = [s for s in _saved_steps(directory) if s <= step]
    if not steps:
        return {}
    path = os.path.join(directory, f"{steps[-1]}.npz")
    try:
        with tf.io.gfile.GFile(path, "rb") as f:
            loaded = np.load(io.BytesIO(f.read()))
            arrays = {name: loaded[name] for name in loaded.files}
    except (OSError, ValueError) as error:
        logging.warning("Callback state %s is unreadable (%s): callbacks start afresh", path, error)
        return {}

    def decode(value):
        if isinstance(value, dict):
            if set(value) == {"__array__"}:
                array = arrays[value["__array__"]]
                return array[()] if array.ndim == 0 else array
            return {k: decode(v) for k, v in value.items()}
        if isinstance(value, list):
            return [decode(v) for v in value]
        return value

    return decode(json.loads(str(arrays.pop("__json__"))))
