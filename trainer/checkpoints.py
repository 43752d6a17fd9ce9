"""Save and restore training state in ``model_dir`` over tf.train.CheckpointManager.

A save is atomic from a reader's point of view: TensorFlow writes the data and index
files first and rewrites the ``checkpoint`` pointer file (atomically) only after
they are complete, so a kill during a save leaves the pointer on the previous
checkpoint. A save that fails (disk full) removes its partial files and says so.
"""

from __future__ import annotations

import logging as pylogging
import os
import re
from collections.abc import Callable

import numpy as np
import tensorflow as tf
from absl import logging

from trainer import config_diff, errors, internals, whole_files
from trainer.errors import UserError

CHECKPOINT_NAME = "ckpt"
POINTER = "checkpoint"  # TensorFlow's list of a model_dir's checkpoints, newest last
# What reading a damaged checkpoint raises (a short file is an IndexError in the reader).
READ_ERRORS = (IndexError, tf.errors.DataLossError, tf.errors.NotFoundError)
OPERATIVE_CONFIG = "operative_config.gin"  # the configuration the checkpoints were trained with


class ConfigRecord:
    """The run's configuration as text, kept beside its checkpoints.

    Args:
      model_dir: where ``operative_config.gin`` is kept.
      text_fn: returns the run's configuration as text (None: nothing is kept).
      guard: ``guard(saved_text, new_text)`` raises UserError when the change is not
        safe to resume with (None: any change is).
      writes: False on workers other than the chief, which check against its record
        but leave the writing to it.
    """

    def __init__(
        self,
        model_dir: str,
        text_fn: Callable[[], str] | None,
        guard: Callable[[str, str], None] | None,
        writes: bool = True,
    ):
        self.path = os.path.join(model_dir, OPERATIVE_CONFIG)
        self.text_fn, self.guard, self.writes = text_fn, guard, writes

    def check(self, misfit: Callable[[], str | None] = lambda: None) -> None:
        """Lets ``guard`` refuse to resume under a changed configuration.

        Checkpoints without a record to check against are refused too: a change
        could not be seen (``guard`` None, as --overwrite_config makes it, resumes).
        ``misfit()`` says why the checkpoints cannot fit this run's model, if they
        cannot: then the refusal does not suggest resuming anyway.
        """
        if self.guard is None or self.text_fn is None:
            return
        saved = self.saved()
        if saved is None:
            raise UserError(
                f"{os.path.dirname(self.path)} has checkpoints but no {OPERATIVE_CONFIG} to "
                "check this run's config against: restore it, or pass --overwrite_config to "
                "resume with this config"
            )
        try:
            self.guard(saved, self.text_fn())
        except config_diff.ConfigChanged as changed:
            reason = misfit()
            if reason is None:
                raise
            raise config_diff.ConfigChanged(changed.changes, reason) from None

    def saved(self) -> str | None:
        """The recorded configuration, or None if there is none."""
        if not tf.io.gfile.exists(self.path):
            return None
        with tf.io.gfile.GFile(self.path) as f:
            return f.read()

    def another_model(self) -> str | None:
        """If the record names another ``experiment.model_fn`` than this run's: says so."""
        saved = self.saved() if self.text_fn is not None else None
        if saved is None:
            return None
        model = config_diff.of(config_diff.changes(saved, self.text_fn()), "experiment.model_fn")
        return None if model is None else config_diff.another_model(model)

    def write(self) -> str | None:
        """Records this run's configuration (once training really starts); returns it."""
        if self.text_fn is None:
            return None
        text = self.text_fn()
        if self.writes:
            whole_files.write_atomically(self.path, text)
        return text

    def remove(self) -> None:
        """Takes back the record (a new run's first save failed)."""
        if self.writes and tf.io.gfile.exists(self.path):
            tf.io.gfile.remove(self.path)


def misfit(path: str, variables: list) -> str | None:
    """Why ``variables`` cannot be restored from checkpoint ``path``, if a shape says so.

    A variable whose shape no saved value has cannot be restored. (Shapes that are
    all there do not prove a fit; the restore itself checks that.)
    """
    saved = {tuple(shape) for _, shape in tf.train.list_variables(path)}
    for variable in variables:
        if tuple(variable.shape) not in saved:
            name = getattr(variable, "path", None) or variable.name
            return f"{name} has shape {tuple(variable.shape)}, which no saved value has"
    return None


def unreachable(root, variables: list) -> list:
    """The ``variables`` a ``tf.train.Checkpoint(model=root)`` would not save."""
    checkpoint = tf.train.Checkpoint(model=root)
    reachable = {id(obj) for obj in internals.checkpoint_descendants(checkpoint)}
    return [v for v in variables if id(v) not in reachable]


def latest_checkpoint(model_dir: str, repair: bool = False) -> str | None:
    """The path prefix of the newest checkpoint in ``model_dir``, or None when there is none.

    The ``checkpoint`` file lists a model_dir's checkpoints. When it is missing or
    unreadable although checkpoints are on disk, they are found by their files
    instead (and, with ``repair``, listed in a new ``checkpoint`` file), so that a
    rerun resumes from them rather than starting over and overwriting them.

    Raises:
      UserError: the newest checkpoint is damaged (a file missing, truncated or
        unreadable); the message names it and the intact ones, and nothing is changed.
    """
    paths = _listed(model_dir)
    if paths is None:
        paths = _found(model_dir)
        if paths:
            logging.warning(
                "%s is missing or unreadable; found %d checkpoints by their files, the newest %s%s",
                os.path.join(model_dir, POINTER),
                len(paths),
                os.path.basename(paths[-1]),
                " (the list is rewritten)" if repair else "",
            )
            if repair:
                relist(model_dir, paths)
    if not paths:
        return None
    problem = damage(paths[-1])
    if problem is not None:
        raise Damaged(paths[-1], problem)
    return paths[-1]


class Damaged(UserError):
    """The newest checkpoint cannot be read back whole; says which older ones can."""

    def __init__(self, path: str, problem: str):
        model_dir, name = os.path.split(path)
        older = [p for p in _listed(model_dir) or _found(model_dir) if step_of(p) < step_of(path)]
        intact = [p for p in older if damage(p) is None]
        if intact:
            fix = (
                f"intact: {', '.join(os.path.basename(p) for p in intact)}; move {name}.* "
                f"out of {model_dir} to resume from {os.path.basename(intact[-1])}"
            )
        else:
            fix = "no older checkpoint is intact: train in a new --model_dir"
        super().__init__(f"checkpoint {path} is damaged ({problem}); {fix}")


def damage(path: str) -> str | None:
    """What is wrong with checkpoint ``path``'s files, or None if they look whole.

    Checks that the index reads and that every data shard is there and at least as
    long as the numbers the index lists (a CRC check of each value happens on restore).
    """
    name = os.path.basename(path)
    if not tf.io.gfile.exists(path + ".index"):
        return f"{name}.index is missing"
    try:
        reader = tf.train.load_checkpoint(path)
    except (tf.errors.OpError, ValueError) as error:
        return f"{name}.index is unreadable: {errors.first_line(error)}"
    shards = tf.io.gfile.glob(path + ".data-*-of-*")
    count = int(shards[0].rsplit("-of-", 1)[1]) if shards else 1
    data = [f"{path}.data-{i:05d}-of-{count:05d}" for i in range(count)]
    missing = [p for p in data if not tf.io.gfile.exists(p)]
    if missing:
        return f"{os.path.basename(missing[0])} is missing"
    needed = numeric_bytes(reader)
    size = sum(tf.io.gfile.stat(p).length for p in data)
    if size < needed:
        where = os.path.basename(data[0]) if count == 1 else f"{name}.data-*"
        return f"{where} holds {size} bytes of the {needed} its index lists: truncated"
    return None


def numeric_bytes(reader) -> int:
    """The bytes a checkpoint's numbers take (its strings, such as a saved iterator, aside)."""
    dtypes = reader.get_variable_to_dtype_map()
    return sum(
        int(np.prod(shape)) * dtypes[key].size
        for key, shape in reader.get_variable_to_shape_map().items()
        if dtypes[key] not in (tf.string, tf.variant, tf.resource)
    )


def read_error(error: Exception) -> str:
    """What a failed read of a checkpoint says, without TensorFlow's op and path."""
    if isinstance(error, tf.errors.OpError):
        return re.sub(r"TensorBundle at \S+ ", "", errors.op_error_text(error))
    return errors.first_line(error)


class RestoreNoise(pylogging.Filter):
    """Drops TensorFlow's warnings about values a restore left unread.

    Every restore here is checked (``assert_existing_objects_matched``, or
    ``expect_partial`` where less is asked for), so these only repeat, at exit, what
    a failed restore has already said in one line.
    """

    def filter(self, record: pylogging.LogRecord) -> bool:
        """False for the two messages."""
        return not record.getMessage().startswith(
            (
                "Detecting that an object or model or tf.train.Checkpoint is being deleted",
                "Value in checkpoint could not be found in the restored object",
            )
        )


def _listed(model_dir: str) -> list[str] | None:
    """The checkpoints the ``checkpoint`` file lists, oldest first (None: no usable list)."""
    if not tf.io.gfile.exists(os.path.join(model_dir, POINTER)):
        return None
    tf_logger = tf.get_logger()
    level = tf_logger.level
    tf_logger.setLevel("ERROR")  # it warns "Checkpoint ignored"; latest_checkpoint says more
    try:
        state = tf.train.get_checkpoint_state(model_dir)
    except (ValueError, UnicodeDecodeError):  # an empty or binary file
        return None
    finally:
        tf_logger.setLevel(level)
    if state is None or not state.model_checkpoint_path:
        return None
    # TensorFlow has already joined each relative entry onto model_dir, relative or not.
    listed = {*state.all_model_checkpoint_paths, state.model_checkpoint_path}
    ours = [os.path.join(model_dir, os.path.basename(p)) for p in listed]
    if any(os.path.normpath(p) != os.path.normpath(o) for p, o in zip(listed, ours, strict=False)):
        return None  # an entry outside model_dir, or not a checkpoint name: not our list
    if any(not re.fullmatch(rf"{CHECKPOINT_NAME}-\d+", os.path.basename(p)) for p in ours):
        return None
    return sorted(ours, key=step_of)


def _found(model_dir: str) -> list[str]:
    """The checkpoints in ``model_dir`` found by their index files, oldest first."""
    pattern = re.compile(rf"{CHECKPOINT_NAME}-(\d+)\.index$")
    names = tf.io.gfile.listdir(model_dir) if tf.io.gfile.isdir(model_dir) else []
    paths = [
        os.path.join(model_dir, name[: -len(".index")]) for name in names if pattern.match(name)
    ]
    return sorted(paths, key=step_of)


def relist(model_dir: str, paths: list[str]) -> None:
    """Writes a new ``checkpoint`` file listing ``paths`` (newest last).

    Each with the time its index was written: a list without times makes TensorFlow's
    CheckpointManager keep every checkpoint it lists forever (``Checkpoints.keep``
    then deletes none of them).
    """
    lines = [f'model_checkpoint_path: "{os.path.basename(paths[-1])}"']
    lines += [f'all_model_checkpoint_paths: "{os.path.basename(p)}"' for p in paths]
    lines += [f"all_model_checkpoint_timestamps: {os.path.getmtime(p + '.index')}" for p in paths]
    lines += ["last_preserved_timestamp: 0.0"]
    whole_files.write_atomically(os.path.join(model_dir, POINTER), "\n".join(lines) + "\n")


def all_checkpoints(model_dir: str) -> list[str]:
    """Every checkpoint the ``checkpoint`` file lists, oldest first."""
    return _listed(model_dir) or []


def saved_ints(path: str | None, **defaults: int) -> dict[str, int]:
    """Integer variables saved in checkpoint ``path``, by name; a default where absent."""
    if path is None:
        return dict(defaults)
    keys = {name: f"{name}/.ATTRIBUTES/VARIABLE_VALUE" for name in defaults}
    try:
        reader = tf.train.load_checkpoint(path)
        return {
            name: int(reader.get_tensor(key)) if reader.has_tensor(key) else defaults[name]
            for name, key in keys.items()
        }
    except READ_ERRORS as error:
        raise Damaged(path, read_error(error)) from None


def step_of(path: str) -> int:
    """The global step a checkpoint path was saved at (``.../ckpt-1200`` -> 1200)."""
    return int(path.rsplit("-", 1)[1])
