"""Save and restore training state in ``model_dir`` over tf.train.CheckpointManager.

A save is atomic from a reader's point of view: TensorFlow writes the data and index
files first and rewrites the ``checkpoint`` pointer file (atomically) only after
they are complete, so a kill during a save leaves the pointer on the previous
checkpoint. A save that fails (disk full) removes its partial files and says so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import tensorflow as tf
from absl import logging

from trainer import errors, files
from trainer.errors import UserError

CHECKPOINT_NAME = "ckpt"
OPERATIVE_CONFIG = "operative_config.gin"  # the configuration the checkpoints were trained with


class ConfigRecord:
    """The run's configuration as text, kept beside its checkpoints.

    Args:
      model_dir: where ``operative_config.gin`` is kept.
      text_fn: returns the run's configuration as text (None: nothing is kept).
      guard: ``guard(saved_text, new_text)`` raises UserError when the change is not
        safe to resume with (None: any change is).
    """

    def __init__(
        self,
        model_dir: str,
        text_fn: Callable[[], str] | None,
        guard: Callable[[str, str], None] | None,
    ):
        self.path = os.path.join(model_dir, OPERATIVE_CONFIG)
        self.text_fn, self.guard = text_fn, guard

    def check(self) -> None:
        """Lets ``guard`` refuse to resume under a changed configuration."""
        if self.guard is None or self.text_fn is None or not tf.io.gfile.exists(self.path):
            return
        with tf.io.gfile.GFile(self.path) as f:
            self.guard(f.read(), self.text_fn())

    def write(self) -> str | None:
        """Records this run's configuration (once training really starts); returns it."""
        if self.text_fn is None:
            return None
        text = self.text_fn()
        files.write_atomically(self.path, text)
        return text


def unreachable(root, variables: list) -> list:
    """The ``variables`` a ``tf.train.Checkpoint(model=root)`` would not save."""
    from tensorflow.python.checkpoint import graph_view  # no public way to list them

    checkpoint = tf.train.Checkpoint(model=root)
    reachable = {id(obj) for obj in graph_view.ObjectGraphView(checkpoint).descendants()}
    return [v for v in variables if id(v) not in reachable]


def latest_checkpoint(model_dir: str) -> str | None:
    """The path prefix of the newest complete checkpoint in ``model_dir``, or None."""
    return tf.train.latest_checkpoint(model_dir)


def all_checkpoints(model_dir: str) -> list[str]:
    """Every checkpoint the ``checkpoint`` index lists, oldest first."""
    state = tf.train.get_checkpoint_state(model_dir)
    if state is None:
        return []
    paths = [
        p if os.path.isabs(p) else os.path.join(model_dir, p)
        for p in state.all_model_checkpoint_paths
    ]
    return sorted(paths, key=step_of)


def saved_ints(path: str | None, **defaults: int) -> dict[str, int]:
    """Integer variables saved in checkpoint ``path``, by name; a default where absent."""
    if path is None:
        return dict(defaults)
    reader = tf.train.load_checkpoint(path)
    keys = {name: f"{name}/.ATTRIBUTES/VARIABLE_VALUE" for name in defaults}
    return {
        name: int(reader.get_tensor(key)) if reader.has_tensor(key) else defaults[name]
        for name, key in keys.items()
    }


def warm_start(model_fn, source: str, pattern: str = ".*") -> None:
    """Takes the weights whose Keras path matches ``pattern`` from checkpoint ``source``.

    ``source`` may be a model_dir (its newest checkpoint). The other weights keep
    their values; the optimizer is not touched.
    """
    path = source
    if tf.io.gfile.isdir(path):
        path = latest_checkpoint(path) or path
    keep = [
        v
        for v in model_fn.trainable_variables + model_fn.non_trainable_variables
        if not re.search(pattern, v.path)
    ]
    kept = [tf.identity(v.value) for v in keep]
    try:
        tf.train.Checkpoint(model=model_fn).restore(path).expect_partial()
    except (tf.errors.OpError, ValueError) as error:
        raise UserError(f"cannot warm-start from {source}: {errors.first_line(error)}") from None
    for v, value in zip(keep, kept, strict=True):
        v.assign(value)
    logging.info("Warm-started from %s (weights matching %r)", path, pattern)


def step_of(path: str) -> int:
    """The global step a checkpoint path was saved at (``.../ckpt-1200`` -> 1200)."""
    return int(path.rsplit("-", 1)[1])


class Checkpointer:
    """Saves every named trackable together and restores the newest checkpoint.

    Args:
      model_dir: where checkpoints and the ``checkpoint`` index file live.
      max_to_keep: how many recent checkpoints to keep (older ones are deleted).
      **trackables: what to save: model, optimizer, step, input iterator, RNG state.
    """

    def __init__(self, model_dir: str, max_to_keep: int = 5, **trackables):
        self.model_dir = model_dir
        self.checkpoint = tf.train.Checkpoint(**trackables)
        model = trackables.get("model")
        self._variables = [  # to name a mismatched variable by its Keras path
            *getattr(model, "trainable_variables", []),
            *getattr(model, "non_trainable_variables", []),
        ]
        self.manager = tf.train.CheckpointManager(
            self.checkpoint, model_dir, max_to_keep=max_to_keep, checkpoint_name=CHECKPOINT_NAME
        )

    @property
    def latest(self) -> str | None:
        """The newest checkpoint's path prefix, or None."""
        return self.manager.latest_checkpoint

    def restore_latest(self, partial: bool = False) -> str | None:
        """Restores the newest checkpoint, if any, and returns its path.

        Args:
          partial: allow the checkpoint to hold state this object does not ask for
            (an evaluator does not need the training input iterator).

        Raises:
          UserError: the checkpoint was written by a different model or input pipeline.
        """
        path = self.latest
        if path is None:
            return None
        try:
            status = self.checkpoint.restore(path)
            if partial:
                status.expect_partial()
            else:
                status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            raise UserError(
                f"checkpoint {path} does not fit this model: {_mismatch(error, self._variables)}; "
                "train in a "
                "new --model_dir, or restore the config this checkpoint was trained with"
            ) from None
        logging.info("Restored %s", path)
        return path

    def restore(self, path: str) -> None:
        """Restores one given checkpoint (used to roll back to the last good state)."""
        self.checkpoint.restore(path).assert_existing_objects_matched()
        logging.info("Restored %s", path)

    def save(self, step: int) -> str:
        """Writes a checkpoint numbered by ``step`` unless one for it exists already.

        Raises:
          UserError: the write failed (disk full, permissions); partial files are removed
            and the previous checkpoint stays the newest.
        """
        if self.latest is not None and step_of(self.latest) == step:
            return self.latest
        try:
            path = self.manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as error:
            self._remove_partial(step)
            reason = errors.first_line(error)
            raise UserError(
                f"could not write checkpoint {CHECKPOINT_NAME}-{step} in {self.model_dir} "
                f"({reason}); free space or choose another --model_dir. The newest complete "
                f"checkpoint is still {self.latest}"
            ) from None
        logging.info("Saved checkpoint %s", path)
        return path

    def _remove_partial(self, step: int) -> None:
        prefix = os.path.join(self.model_dir, f"{CHECKPOINT_NAME}-{step}")
        for path in tf.io.gfile.glob(prefix + ".*") + tf.io.gfile.glob(prefix + "_temp*"):
            if tf.io.gfile.isdir(path):
                tf.io.gfile.rmtree(path)
            else:
                tf.io.gfile.remove(path)


def _mismatch(error: Exception, variables: list) -> str:
    """Names the variables a failed restore complained about, in one line.

    TensorFlow names a variable by its short name (``dense/kernel``); when exactly one
    of ``variables`` has the shape it complains about, its Keras path is used instead.
    """
    text = str(error)
    if "DeserializeIterator" in text:
        return (
            "its saved input position does not fit this input pipeline (did the input_fn change?)"
        )
    shapes = re.search(
        r"incompatible tensor with shape (\(.*?\)) when attempting to restore "
        r"variable with shape (\(.*?\)) and name (\S+)",
        text,
    )
    if shapes:
        name = re.sub(r"(:0)?\.?$", "", shapes.group(3))
        same = [v.path for v in variables if str(tuple(v.shape)) == shapes.group(2)]
        name = same[0] if len(same) == 1 else name
        return f"{name} has shape {shapes.group(2)} here but {shapes.group(1)} in the checkpoint"
    paths = sorted(set(re.findall(r"path=([^,>\s]+)", text)))
    if paths:
        shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
        return f"no saved value for {shown}"
    return errors.first_line(text)
